"""Where the gateway's CPU goes: py-spy flame graphs of non-streaming requests, of streams written at once and of
paced streams.

The rig of bench/gateway_peers.py (two fast fake replicas and wrk on the first cores, the gateway alone on the
last, API keys on), one scenario at a time: wrk drives the gateway while py-spy samples it, and writes an SVG flame
graph and the raw stacks (`--out`, default docs/bench/profiles/), plus a summary of the hottest functions and lines
(self time: what a change can win back).

    python -m bench.profile_gateway [--seconds 10] [--only NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.common import RESULTS
from bench.gateway_overhead import wrk
from bench.gateway_peers import KEY, PACED_MS, _ours, cpus, fake_replicas, pinned, started
from deploy.ports import free_ports

SCENARIOS = {
    "requests": ({"model": "fake-model", "prompt": "hello", "max_tokens": 16}, 32),
    "stream-back-to-back": ({"model": "fake-model", "prompt": "hello", "max_tokens": 64, "stream": True}, 32),
    f"stream-paced-{PACED_MS}ms": ({"model": "fake-model", "prompt": "hello", "max_tokens": 64, "stream": True,
                                   "bench_itl_ms": PACED_MS}, 64),
}


def hottest(raw: Path, n: int = 15) -> list[tuple[float, str]]:
    """The lines with the most self time in py-spy's raw output (share of the non-idle samples)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            counts[stack.split(";")[-1]] += int(count)
    total = sum(counts.values()) or 1
    return [(c / total, frame) for frame, c in counts.most_common(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "profiles")
    parser.add_argument("--only", action="append", choices=list(SCENARIOS), help="this scenario only (repeatable)")
    args = parser.parse_args()
    scenarios = {name: SCENARIOS[name] for name in args.only or SCENARIOS}
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("bench: py-spy is needed (pip install py-spy)")
    load_cores, gateway_core = cpus()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="profile-"))
    lines = []
    with ExitStack() as stack:
        replicas = fake_replicas(stack, 2, load_cores, workdir)
        port = free_ports()
        url = f"http://127.0.0.1:{port}"
        gateway = stack.enter_context(started(pinned(_ours(port, replicas, workdir), gateway_core), url,
                                              workdir / "gateway.log"))
        for name, (body, connections) in scenarios.items():
            for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
                sampler = subprocess.Popen([spy, "record", "--nonblocking", "-r", "500", "-d", str(int(args.seconds)),
                                            "-p", str(gateway.pid), "-f", fmt, "-o",
                                            str(args.out / f"{name}.{suffix}")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
                result = wrk(url, body, connections, args.seconds - 1, auth=KEY, cores=load_cores)
                sampler.wait(timeout=args.seconds + 60)
            lines += [f"## {name} ({result.requests_per_s:.0f} answers/s, {connections} connections)", "",
                      "| self | function (file:line) |", "|---:|---|"]
            lines += [f"| {share:.1%} | `{frame}` |" for share, frame in hottest(args.out / f"{name}.txt")]
            lines.append("")
    text = "\n".join(["# Gateway profiles (py-spy)", "", f"`python -m bench.profile_gateway --seconds "
                      f"{args.seconds:g}`: flame graphs beside this file ({', '.join(f'{n}.svg' for n in scenarios)})."
                      " Self time per line, of the samples py-spy took (the event loop's own C code, and its idle "
                      "waits, show as `Runner.run`).", "", *lines])
    (args.out / "README.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
