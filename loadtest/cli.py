"""`loadtest`: run the packaged locustfile headless against one target or several, and report.

    loadtest run --host URL --model M --arrival poisson --rate 5 --duration 60 --out runs/p5
    loadtest compare --target gw=URL --target rr=URL1,URL2 --model M ... --out runs/cmp
    loadtest report runs/p5           # recompute summary, table and plots from a run's records
    loadtest locustfile               # the locustfile's path, for `locust -f` and its web UI

`--no-plots` leaves the PNGs out of a run (matplotlib's import and three figures: 2-3 s a run on a 2-core VM);
`loadtest report` draws them later.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from loadtest.config import LoadConfig, add_arguments, config_from_dict, config_from_options, split_hosts
from loadtest.records import RequestRecord
from loadtest.report import RunInfo, summarize
from loadtest.runner import LOCUSTFILE, RunFailed, locust_command, read_output, run_locust
from loadtest.schedules import build_schedule, bursts_of
from loadtest.table import format_table
from loadtest.chats import build_chats
from loadtest.workloads import build_workload

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadtest", description="Open-loop LLM load tests with Locust")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one load test headless and report it")
    run.add_argument("--host", action="append", required=True, metavar="URL",
                     help="target base URL; several (repeated or comma-separated): client-side round-robin")
    _common(run)
    compare = sub.add_parser("compare", help="run the same seeded load against several targets, side by side")
    compare.add_argument("--target", action="append", required=True, metavar="NAME=URL[,URL...]",
                         help="a named target; several URLs: client-side round-robin over them")
    _common(compare)
    report = sub.add_parser("report", help="recompute the summary, table and plots of a finished run")
    report.add_argument("out", metavar="DIR", help="the run's output directory")
    sub.add_parser("locustfile", help="print the path of the packaged locustfile")
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--dry-run", action="store_true", help="print the schedule's size and the commands only")
    parser.add_argument("--no-plots", dest="plots", action="store_false",
                        help="write no PNGs (`loadtest report DIR` draws them from the records later)")
    add_arguments(parser)


def parse_targets(values: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """NAME=URL[,URL...] items into an ordered name -> hosts mapping."""
    targets: dict[str, tuple[str, ...]] = {}
    for item in values:
        name, sep, urls = item.partition("=")
        if not sep or not name or not urls or "/" in name:
            raise ValueError(f"target {item!r} is not NAME=URL[,URL...]")
        if name in targets:
            raise ValueError(f"target name {name!r} is given twice")
        targets[name] = split_hosts(urls)
    return targets


def schedule_of(config: LoadConfig) -> list[float] | None:
    """The open-loop send times `config` describes; None in closed loop."""
    return build_schedule(config.arrival).tolist() if config.mode == "open" else None


def run_info(config: LoadConfig, schedule: list[float] | None) -> RunInfo:
    """What the report needs to know about the run besides its records."""
    if schedule is None:
        return RunInfo("closed", config.arrival.duration)
    if config.workload.kind == "multiturn":  # the schedule starts conversations, not requests
        return RunInfo("open", config.arrival.duration, conversations=len(schedule))
    return RunInfo("open", config.arrival.duration, scheduled=len(schedule),
                   bursts_s=tuple(bursts_of(config.arrival)), burst_period_s=config.arrival.burst_period)


def report_run(config: LoadConfig, records: list[RequestRecord], out: Path, plots: bool = True) -> dict[str, Any]:
    """Write summary.json and (unless not `plots`) the plots of one run; return the summary."""
    schedule = schedule_of(config)
    info = run_info(config, schedule)
    summary = summarize(records, info)
    (out / SUMMARY_FILE).write_text(json.dumps({**summary, "config": asdict(config)}, indent=2) + "\n",
                                    encoding="utf-8")
    if plots:
        from loadtest.plots import write_run_plots  # matplotlib: imported only where something is drawn

        write_run_plots(records, out, schedule, info.bursts_s)
    return summary


def _describe(config: LoadConfig) -> str:
    schedule = schedule_of(config)
    unit = "conversations" if config.workload.kind == "multiturn" else "requests"
    what = (f"{len(schedule)} {unit} over {config.arrival.duration:g} s ({config.arrival.kind})"
            if schedule is not None else f"closed loop, {config.concurrency} in flight")
    return f"{what} -> {', '.join(config.hosts)}"


def _dry_run(config: LoadConfig, out: Path, prefix: str = "") -> None:
    print(f"{prefix}{_describe(config)}\n  {shlex.join(locust_command(config, out))}")


def cmd_run(config: LoadConfig, out: Path, dry_run: bool, plots: bool = True) -> int:
    if dry_run:
        _dry_run(config, out)
        return 0
    print(f"loadtest: {_describe(config)} (log: {out / 'locust.log'})", file=sys.stderr)
    result = run_locust(config, out)
    summary = report_run(config, result.records, out, plots)
    print(format_table([summary]))
    print(f"results in {out}/: {SUMMARY_FILE}, records.jsonl, locust_*.csv, locust.html{', *.png' if plots else ''}")
    return 0


def cmd_compare(config: LoadConfig, targets: dict[str, tuple[str, ...]], out: Path, dry_run: bool,
                plots: bool = True) -> int:
    # Same schedule and lengths everywhere, other prompt text per target: targets that share replicas must not
    # find each other's prompts in the prefix cache.
    runs = {name: replace(config, hosts=hosts, out_dir=str(out / name),
                          workload=replace(config.workload, prompt_salt=config.workload.prompt_salt + i))
            for i, (name, hosts) in enumerate(targets.items())}
    if dry_run:
        for name, each in runs.items():
            _dry_run(each, out / name, f"{name}: ")
        return 0
    summaries, records = {}, {}
    for name, each in runs.items():
        print(f"loadtest: {name}: {_describe(each)}", file=sys.stderr)
        result = run_locust(each, out / name)
        records[name] = result.records
        summaries[name] = report_run(each, result.records, out / name, plots)
    (out / "compare.json").write_text(json.dumps(summaries, indent=2) + "\n", encoding="utf-8")
    if plots:
        from loadtest.plots import latency_cdfs, per_replica

        latency_cdfs(records, out / "compare_latency_cdf.png")
        per_replica(records, out / "compare_replicas.png")
    print(format_table(list(summaries.values()), list(summaries)))
    print(f"results in {out}/: compare.json{', compare_*.png' if plots else ''}, and one directory per target")
    return 0


def cmd_report(out: Path) -> int:
    result = read_output(out)
    config = config_from_dict(result.meta["config"])
    print(format_table([report_run(config, result.records, out)]))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(_dispatch(args))
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as e:
        print(f"loadtest: run failed: {e}", file=sys.stderr)
        sys.exit(1)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "locustfile":
        print(LOCUSTFILE)
        return 0
    if args.command == "report":
        return cmd_report(Path(args.out))
    out = Path(args.out)
    targets = {"run": split_hosts(args.host)} if args.command == "run" else parse_targets(args.target)
    config = config_from_options(args, next(iter(targets.values())), str(out))
    if config.workload.kind == "multiturn":
        build_chats(config.workload)  # a bad dataset fails here, not in the Locust subprocess
    else:
        build_workload(config.workload)
    if args.command == "run":
        return cmd_run(config, out, args.dry_run, args.plots)
    return cmd_compare(config, targets, out, args.dry_run, args.plots)


if __name__ == "__main__":
    main()
