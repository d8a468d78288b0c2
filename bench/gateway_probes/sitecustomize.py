"""Probes for a gateway process started by a benchmark: put this directory on PYTHONPATH and name a directory in
GATEWAY_PROBES_DIR. In a `gateway.cli` process (only there), they log to GATEWAY_PROBES_DIR/probes-PID.txt, with
Unix times: every garbage collection over 5 ms, and every wake-up of a task on the gateway's loop more than 20 ms
late (it sleeps 5 ms at a time, from the moment the gateway serves). docs/priority.md reads them beside the spans.

    GATEWAY_PROBES_DIR=/tmp/probes PYTHONPATH=.:bench/gateway_probes python -m bench.fairness_vllm ... --trace
"""

import os


def _install(directory: str) -> None:
    import asyncio
    import gc
    import time

    import gateway.app as app

    log = open(os.path.join(directory, f"probes-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115 (lives on)
    started = [0.0]

    def collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) > 0.005:
            log.write(f"gc {time.time():.4f} gen{info['generation']} {took * 1e3:.1f}ms collected {info['collected']}\n")

    async def lateness() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            if (late := time.perf_counter() - before - 0.005) > 0.02:
                log.write(f"lag {time.time():.4f} {late * 1e3:.1f}ms\n")

    freeze = app.freeze_startup_objects

    def serving() -> None:  # called once the gateway serves, on its loop
        freeze()
        asyncio.get_running_loop().create_task(lateness())

    gc.callbacks.append(collection)
    app.freeze_startup_objects = serving


def _is_gateway() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"gateway.cli" in f.read()
    except OSError:
        return False


if os.environ.get("GATEWAY_PROBES_DIR") and _is_gateway():
    _install(os.environ["GATEWAY_PROBES_DIR"])
