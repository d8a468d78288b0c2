"""Locustfile: open-loop (scheduled) or closed-loop LLM load with streaming OpenAI requests.

Run it as users expect, headless or with the web UI (its options show in the UI form):

    locust -f "$(loadtest locustfile)" -H http://localhost:8000 --model M --arrival poisson --rate 5 \
        --duration 60 -u 1

One Locust user (fixed_count = 1) is the dispatcher: in open loop it spawns a greenlet per request at
the request's scheduled time, so the offered rate does not drop when the server slows down. Each
request reports to Locust as request type POST (end-to-end latency; "size" is output tokens), TTFT,
TPOT, ITL (one per gap between tokens) and LAG (scheduled -> actual send time); failures carry their
reason. With --out DIR the exact per-request records go to DIR/records.jsonl (for `loadtest run`'s
report). When the schedule is done the test stops (headless: Locust exits).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import gevent
from locust import User, events, task
from locust.exception import StopUser
from locust.runners import STATE_RUNNING, STATE_SPAWNING
from locust.stats import CSV_STATS_INTERVAL_SEC

from loadtest.client import StreamingClient
from loadtest.config import LoadConfig, add_arguments, config_from_options, split_hosts
from loadtest.dispatch import DispatchResult, Dispatcher
from loadtest.records import META_FILE, RECORDS_FILE, RequestRecord, write_records
from loadtest.schedules import build_schedule
from loadtest.sse import RequestFailed
from loadtest.chats import build_chats
from loadtest.workloads import build_workload

logger = logging.getLogger(__name__)


def _add_options(parser: Any, **_kwargs: Any) -> None:
    add_arguments(parser)
    parser.add_argument("--hosts", default="", help="comma-separated hosts to round-robin over (default: --host)")
    parser.add_argument("--out", default="", help="directory for records.jsonl and meta.json")


events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]  # locust's hook is untyped


class LocustReporter:
    """Reports each record through Locust's request event and appends it to records.jsonl."""

    def __init__(self, request_event: Any, config: LoadConfig, records: IO[str] | None) -> None:
        self._fire = request_event.fire
        self._name = config.path
        self._records = records

    def __call__(self, record: RequestRecord) -> None:
        if self._records is not None:
            write_records(self._records, [record])
        url = record.target + self._name
        if not record.ok:
            self._event("POST", record.e2e_s, 0, url, RequestFailed(record.error))
        else:
            self._event("POST", record.e2e_s, record.output_tokens, url)
            if record.ttft_s is not None:
                self._event("TTFT", record.ttft_s, 0, url)
            if record.tpot_s is not None:
                self._event("TPOT", record.tpot_s, 0, url)
            for gap in record.itl_s:
                self._event("ITL", gap, 0, url)
        if record.lag_s is not None:
            self._event("LAG", record.lag_s, 0, url, name="schedule")

    def _event(self, kind: str, seconds: float, length: int, url: str, exception: Exception | None = None,
               name: str | None = None) -> None:
        self._fire(request_type=kind, name=name or self._name, response_time=seconds * 1000,
                   response_length=length, exception=exception, context={}, url=url)


class LLMUser(User):
    """The dispatcher: one per test, whatever the user count says."""

    fixed_count = 1

    @task
    def run_load(self) -> None:
        env = self.environment
        opts = env.parsed_options
        try:
            config = config_from_options(opts, split_hosts(opts.hosts or env.host or ""), opts.out or None)
        except ValueError as e:
            logger.error("load test not started: %s", e)
        else:
            try:
                _run(config, env.events.request)
            except Exception:
                # StopUser below would swallow it; meta.json says the run did not finish.
                logger.exception("load test failed")
        finally:
            self._end_test()

    def _end_test(self) -> None:
        env = self.environment
        runner = env.runner
        if runner is not None and runner.state in (STATE_SPAWNING, STATE_RUNNING):
            if env.parsed_options.csv_prefix:
                # Locust's CSV writer snapshots the stats every interval and writes nothing more at exit:
                # let it take one snapshot after the last request.
                gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
            # Stop from another greenlet: stopping kills this user's greenlet, which must not be the caller.
            gevent.spawn(runner.quit if env.parsed_options.headless else runner.stop)
        raise StopUser()


def _run(config: LoadConfig, request_event: Any) -> None:
    out = Path(config.out_dir) if config.out_dir else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    client = StreamingClient(config, api_key=os.environ.get("OPENAI_API_KEY"))
    records = (out / RECORDS_FILE).open("w", encoding="utf-8") if out else None
    started = time.time()
    result: DispatchResult | None = None
    dispatcher = Dispatcher(client, LocustReporter(request_event, config, records), config.drain_timeout)
    try:
        result = _run_chats(config, dispatcher) if config.workload.kind == "multiturn" else \
            _run_requests(config, dispatcher)
    finally:
        dispatcher.stop()  # a test stopped from the web UI leaves requests in flight
        client.close()
        if records is not None:
            records.close()
        if out is not None:
            _write_meta(out / META_FILE, config, started, result)


def _run_requests(config: LoadConfig, dispatcher: Dispatcher) -> DispatchResult:
    workload = build_workload(config.workload)
    if config.mode == "open":
        times = build_schedule(config.arrival)
        logger.info("open loop: %d requests over %.0f s to %s", len(times), config.arrival.duration,
                    ", ".join(config.hosts))
        result = dispatcher.open_loop(workload, times.tolist())
    else:
        logger.info("closed loop: %d in flight to %s", config.concurrency, ", ".join(config.hosts))
        result = dispatcher.closed_loop(workload, config.concurrency, config.num_requests, config.arrival.duration)
    logger.info("load done: %d sent, at most %d in flight", result.sent, result.max_in_flight)
    return result


def _run_chats(config: LoadConfig, dispatcher: Dispatcher) -> DispatchResult:
    chats = build_chats(config.workload)
    if config.mode == "open":
        times = build_schedule(config.arrival)
        logger.info("open loop: %d conversations over %.0f s to %s", len(times), config.arrival.duration,
                    ", ".join(config.hosts))
        result = dispatcher.open_loop_chats(chats, times.tolist())
    else:
        logger.info("closed loop: %d conversations at a time to %s", config.concurrency, ", ".join(config.hosts))
        result = dispatcher.closed_loop_chats(chats, config.concurrency, config.num_requests, config.arrival.duration)
    logger.info("load done: %d turns sent, at most %d in flight", result.sent, result.max_in_flight)
    return result


def _write_meta(path: Path, config: LoadConfig, started: float, result: DispatchResult | None) -> None:
    meta = {
        "started_unix": started,
        "finished": result is not None,
        "scheduled": result.scheduled if result else None,
        "sent": result.sent if result else None,
        "drained": result.drained if result else None,
        "max_in_flight": result.max_in_flight if result else None,
        "config": asdict(config),
    }
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
