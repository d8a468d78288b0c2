"""How often the headroom's flood test takes a closed-loop flood for one, on a real vLLM-CPU replica.

tests/test_priority_vllm.py's tenants phase: eight clients of one heavy tenant send 32-token completions back to
back in the interactive band, beside one light tenant's 4-token requests 0.1 s apart (bench/priority_load.py;
gateway `max_requests: 4`, `queue.headroom: 2`). The heavy tenant is held to 2 slots only while the flood test
(gateway/askrates.py, `AskRates.outpaces`) says it outpaces the others of its band; this wraps that test and counts
its answers per tenant, each round on a fresh gateway after the test's alone and priority phases.

    python -m bench.flood_test_vllm [--rounds 4] [--replica URL] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.priority_load import gateway, gateway_config, phase
from bench.priority_vllm import MODEL, replica_server
from gateway.askrates import AskRates, Kind

CAP, HEADROOM, FLOOD, SAMPLES, GAP_S = 4, 2, 8, 30, 0.1  # tests/test_priority_vllm.py's


@contextmanager
def counted(tally: collections.Counter[tuple[str, bool]]) -> Iterator[None]:
    """While open, every `AskRates.outpaces` answer is counted in `tally` by (tenant, answer)."""
    original: Callable[[AskRates, Kind, float, float, int], bool] = AskRates.outpaces

    def outpaces(self: AskRates, kind: Kind, now: float, factor: float, asks: int = 0) -> bool:
        answer = original(self, kind, now, factor, asks)
        tally[(kind[0], answer)] += 1
        return answer

    AskRates.outpaces = outpaces  # type: ignore[method-assign]
    try:
        yield
    finally:
        AskRates.outpaces = original  # type: ignore[method-assign]


async def one_round(url: str) -> dict[str, Any]:
    tally: collections.Counter[tuple[str, bool]] = collections.Counter()
    async with gateway(gateway_config(url, CAP, HEADROOM)) as base:
        alone = await phase(base, MODEL, 0, SAMPLES, GAP_S)
        await phase(base, MODEL, FLOOD, SAMPLES, GAP_S)  # the batch flood by priority, as the test runs it first
        with counted(tally):
            tenants = await phase(base, MODEL, FLOOD, SAMPLES, GAP_S, flood_as=("interactive", "heavy"))
    held, asked = tally[("heavy", True)], tally[("heavy", True)] + tally[("heavy", False)]
    return {"alone_p99_ms": round(alone.p(99) * 1e3, 1),
            "tenants_ms": {f"p{q}": round(tenants.p(q) * 1e3, 1) for q in (50, 90, 99)},
            "p99_x_alone": round(tenants.p(99) / alone.p(99), 2), "heavy_served": tenants.batch_done,
            "heavy_taken_for_a_flood": held, "heavy_tested": asked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flood_test_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--replica", help="a running replica as tests/test_priority_vllm.py's (default: start one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rounds = []
    with ExitStack() as stack:
        url = args.replica or stack.enter_context(replica_server(Path(tempfile.mkdtemp()) / "vllm.log")).url
        for k in range(args.rounds):
            row = asyncio.run(one_round(url))
            rounds.append(row)
            print(f"round {k}: alone p99 {row['alone_p99_ms']} ms; under the heavy tenant {row['tenants_ms']} "
                  f"({row['p99_x_alone']} x alone); heavy served {row['heavy_served']}, taken for a flood in "
                  f"{row['heavy_taken_for_a_flood']} of {row['heavy_tested']} tests", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rounds": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
