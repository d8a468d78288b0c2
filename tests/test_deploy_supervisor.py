"""The supervisor: restarts with backoff, one start at a time, health tracking (fake processes, fake clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.supervisor import Backoff, Supervisor


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    """A process whose life the test scripts: alive or dead, healthy or not."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log_path = Path(f"/logs/{name}.log")
        self.alive = True
        self.up = True  # answers its health probe
        self.code: int | None = None
        self.starts = 0
        self.stops = 0
        self._pid = 100

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self) -> None:
        self.starts += 1
        self._pid += 1
        self.alive, self.up, self.code = True, False, None

    def poll(self) -> int | None:
        return None if self.alive else self.code

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.alive and self.up

    def stop(self) -> None:
        self.stops += 1
        self.alive = False
        self.code = self.code if self.code is not None else -15

    def die(self, code: int = -9) -> None:
        self.alive, self.code = False, code


def make(n: int = 2, **kw: float) -> tuple[Supervisor, list[FakeProcess], Clock]:
    clock = Clock()
    sup = Supervisor(Backoff(initial_s=1, factor=2, max_s=8, reset_after_s=30), clock=clock,
                     probe_interval_s=0.0, **kw)
    procs = [FakeProcess(f"r{i}") for i in range(n)]
    for p in procs:
        sup.add(p, f"http://127.0.0.1:{8001 + procs.index(p)}")
    return sup, procs, clock


def test_backoff_doubles_and_caps() -> None:
    """Delays go 1, 2, 4, 8, 8 ... seconds."""
    backoff = Backoff(initial_s=1, factor=2, max_s=8)
    assert [backoff.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


def test_bad_backoff_is_rejected() -> None:
    """A backoff whose cap is below its first delay is an error."""
    with pytest.raises(ValueError):
        Backoff(initial_s=5, max_s=1)


def test_dead_process_is_restarted_after_its_backoff() -> None:
    """A process that dies waits out its backoff, is started again, and counts one restart."""
    sup, (r0, _), clock = make()
    r0.die()
    assert sup.tick()
    assert sup.slots[0].status == "backoff" and not sup.slots[0].healthy
    clock.now = 0.5
    sup.tick()
    assert r0.starts == 0
    clock.now = 1.0
    sup.tick()
    assert r0.starts == 1 and sup.slots[0].status == "starting" and sup.slots[0].restarts == 1
    r0.up = True
    sup.tick()
    assert sup.slots[0].status == "running" and sup.slots[0].healthy
    assert sup.views()[0].restarts == 1 and sup.views()[0].pid == r0.pid


def test_repeated_failures_back_off_longer() -> None:
    """Each failure in a row doubles the wait before the next start."""
    sup, (r0, _), clock = make()
    waits = []
    for _ in range(4):
        r0.die()
        sup.tick()
        waits.append(sup.slots[0].next_start_at - clock.now)
        clock.now = sup.slots[0].next_start_at
        sup.tick()  # restarted, never gets healthy: dies again next round
    assert waits == [1, 2, 4, 8]


def test_failure_count_resets_after_a_healthy_spell() -> None:
    """Healthy for reset_after_s: the next death waits the first delay again."""
    sup, (r0, _), clock = make()
    for _ in range(3):
        r0.die()
        sup.tick()
        clock.now = sup.slots[0].next_start_at
        sup.tick()
    r0.up = True
    sup.tick()
    assert sup.slots[0].failures == 3
    clock.now += 31
    sup.tick()
    assert sup.slots[0].failures == 0
    r0.die()
    sup.tick()
    assert sup.slots[0].next_start_at - clock.now == 1


def test_one_start_at_a_time() -> None:
    """Two dead replicas are started one after the other, never together (shared-GPU memory profiling)."""
    sup, (r0, r1), clock = make()
    r0.die()
    r1.die()
    sup.tick()
    clock.now = 5
    sup.tick()
    assert (r0.starts, r1.starts) == (1, 0)
    sup.tick()
    assert r1.starts == 0
    r0.up = True
    sup.tick()
    sup.tick()
    assert r1.starts == 1


def test_a_start_that_never_gets_healthy_is_stopped_and_retried() -> None:
    """A restart not healthy within the startup timeout is stopped and counts as a failure."""
    sup, (r0, _), clock = make(startup_timeout_s=10)
    r0.die()
    sup.tick()
    clock.now = 1
    sup.tick()
    stops = r0.stops
    clock.now = 12
    sup.tick()
    assert r0.stops == stops + 1
    assert sup.slots[0].status == "backoff" and sup.slots[0].failures == 2


def test_unhealthy_but_alive_is_reported_not_restarted() -> None:
    """A live process that fails its probe shows unhealthy; the supervisor leaves it to the gateway."""
    sup, (r0, _), _ = make()
    r0.up = False
    assert sup.tick()
    assert sup.slots[0].status == "running" and not sup.slots[0].healthy and r0.starts == 0
    r0.up = True
    sup.tick()
    assert sup.slots[0].healthy


def test_stop_all_stops_in_reverse_order() -> None:
    """stop_all stops the last added first and marks everything stopped."""
    sup, procs, _ = make(3)
    order: list[str] = []
    for p in procs:
        p.stop = lambda p=p: order.append(p.name)  # type: ignore[method-assign]
    sup.stop_all()
    assert order == ["r2", "r1", "r0"]
    assert all(v.status == "stopped" and v.pid is None for v in sup.views())


def test_a_restart_that_logs_nothing_is_stopped_and_retried_before_the_startup_timeout(tmp_path: Path) -> None:
    """A restarted process whose log stays silent past silent_start_s is wedged: stopped and started again, while
    one that keeps logging is left to start for as long as the startup timeout allows."""
    sup, (r0, r1), clock = make(startup_timeout_s=600, silent_start_s=30)
    for proc in (r0, r1):
        proc.log_path = tmp_path / f"{proc.name}.log"
        proc.log_path.write_text("up\n")
    assert sup.restart("r0") and sup.restart("r1")
    for t in range(1, 100):
        clock.now = t
        with r1.log_path.open("a") as log:
            log.write("still loading\n")
        sup.tick()
        if sup.slots[0].status != "starting":
            break
    assert sup.slots[0].status == "backoff" and 30 < clock.now <= 32 and r0.stops == 2
    assert sup.slots[1].status == "starting" and r1.stops == 1
    clock.now += 2
    sup.tick()
    assert sup.slots[0].status == "backoff"  # one start at a time: r1 is still starting
    r1.up = True
    sup.tick()
    sup.tick()
    assert sup.slots[1].status == "running" and sup.slots[0].status == "starting" and r0.starts == 2
