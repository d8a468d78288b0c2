"""`python -m synthetic.verify`: compare each shipped config.json with the hub's (needs the network).

Prints one line per model: `same`, the fields that differ, or why it could not be fetched (gated repositories such
as meta-llama's need `HF_TOKEN`). Exits 1 when a fetched config differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from synthetic.catalog import ENTRIES, Entry

# Keys that say nothing about the architecture (tooling versions, training-only settings).
IGNORED = {"transformers_version", "_name_or_path", "use_cache", "initializer_range"}


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """`key: ours != theirs` for every architecture key that differs (pure)."""
    keys = sorted((set(ours) | set(theirs)) - IGNORED)
    return [f"{k}: {ours.get(k)!r} != {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]


def fetch(item: Entry, timeout_s: float) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(item.hub_id, "config.json", etag_timeout=timeout_s)
    with open(path) as f:
        data = json.load(f)
    assert isinstance(data, dict)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m synthetic.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (10)")
    args = parser.parse_args(argv)
    differ = False
    for name, item in sorted(ENTRIES.items()):
        try:
            theirs = fetch(item, args.timeout)
        except Exception as exc:  # noqa: BLE001 - the hub client's errors have no common base; we only report them
            print(f"{name}: not fetched ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        found = differences(item.config(), theirs)
        differ = differ or bool(found)
        print(f"{name}: " + ("same as " + item.hub_id if not found else "; ".join(found)))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
