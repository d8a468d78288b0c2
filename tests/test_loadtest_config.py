"""Load-test config: options round-trip to the Locust subprocess, validation, targets, and no Locust import."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from loadtest.cli import main, parse_targets
from loadtest.config import LoadConfig, config_from_dict, config_from_options, make_parser, split_hosts, to_argv
from loadtest.runner import LOCUSTFILE, locust_command
from loadtest.schedules import ArrivalSpec, poisson
from loadtest.workloads import RequestSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]


def _config(**kwargs: object) -> LoadConfig:
    base: dict = {"hosts": ("http://a:1",), "model": "m"}
    return LoadConfig(**{**base, **kwargs})


def _parse(argv: list[str], hosts: tuple[str, ...] = ("http://a:1",)) -> LoadConfig:
    return config_from_options(make_parser().parse_args(argv), hosts, None)


def test_options_round_trip_through_to_argv() -> None:
    """Parsing to_argv(config) gives back the same config, for every field."""
    config = _config(
        endpoint="chat", mode="closed", concurrency=7, num_requests=90, ignore_eos=False, read_timeout=33.0,
        connect_timeout=2.5, drain_timeout=4.0, max_connections=50, chat_hosts="turn",
        arrival=ArrivalSpec(kind="ramp", rate=2.5, duration=42.0, burstiness=0.25, burst_size=3, burst_period=7.5,
                            steps=((0.0, 1.0), (10.0, 4.5)), seed=11),
        workload=WorkloadSpec(kind="mix", input_len=100, output_len=20, range_ratio=0.3, sigma=0.9,
                              sharegpt_output_len=12, short=(10, 2), long=(300, 40), long_fraction=0.4, tokenizer="/t",
                              prompt_salt=3,
                              seed=11),
    )
    assert _parse(to_argv(config)) == config


def test_web_ui_strings_and_blank_fields_are_accepted() -> None:
    """Every option may arrive as text (the web UI); blank optional fields mean 'not set'."""
    config = _parse(["--model", "m", "--rate", " 2.5 ", "--num-requests", "", "--duration", ""])
    assert config.arrival.rate == 2.5 and config.num_requests is None and config.arrival.duration == 60.0


def test_closed_loop_with_a_request_count_needs_no_duration() -> None:
    """Closed loop with --num-requests and no --duration runs until the count is reached."""
    config = _parse(["--model", "m", "--mode", "closed", "--concurrency", "4", "--num-requests", "100"])
    assert math.isinf(config.arrival.duration)


def test_meta_json_config_comes_back() -> None:
    """config_from_dict inverts asdict through JSON (as meta.json stores it)."""
    config = _config(arrival=ArrivalSpec(kind="step", steps=((0.0, 1.0), (5.0, 2.0))))
    assert config_from_dict(json.loads(json.dumps(asdict(config)))) == config


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "m", "--rate", "fast"], "rate 'fast' is not a number"),
    (["--model", "m", "--steps", "0-5"], "steps item '0-5' is not a:b"),
    (["--model", "m", "--short", "10"], "short '10' is not input:output"),
    (["--model", "m", "--concurrency", "0"], "concurrency 0"),
    (["--rate", "1"], "no model"),
])
def test_bad_options_name_the_bad_value(argv: list[str], message: str) -> None:
    """Bad option values are refused with the value in the message."""
    with pytest.raises(ValueError, match=message):
        _parse(argv)


def test_hosts_are_checked_and_split() -> None:
    """Hosts split on commas, lose trailing slashes, and must be http(s) URLs."""
    assert split_hosts(["http://a:1/,http://b:2", "https://c"]) == ("http://a:1", "http://b:2", "https://c")
    with pytest.raises(ValueError, match="'localhost:8000' is not an http"):
        _config(hosts=("localhost:8000",))


def test_requests_spread_over_the_hosts_and_conversations_keep_theirs_or_go_turn_by_turn() -> None:
    """Request i goes to host i mod N; a conversation keeps host c mod N, or with --chat-hosts turn its turn t goes
    to host (c + t) mod N (behind a load balancer); another value is refused by name."""
    hosts = ("http://a:1", "http://b:2", "http://c:3")
    single = [RequestSpec(i, "p", 8, 4) for i in range(4)]
    assert [_config(hosts=hosts).host_of(r) for r in single] == [0, 1, 2, 0]
    turns = [RequestSpec(10 + t, "p", 8, 4, conversation=4, turn=t) for t in range(4)]
    assert [_config(hosts=hosts).host_of(r) for r in turns] == [1, 1, 1, 1]
    assert [_config(hosts=hosts, chat_hosts="turn").host_of(r) for r in turns] == [1, 2, 0, 1]
    assert _parse(["--model", "m", "--chat-hosts", "turn"]).chat_hosts == "turn"
    with pytest.raises(ValueError, match="chat hosts 'gateway'"):
        _config(chat_hosts="gateway")


def test_targets_parse_names_and_round_robin_urls() -> None:
    """NAME=URL[,URL] targets keep their order; malformed or repeated names are refused."""
    assert parse_targets(["gw=http://g:1", "rr=http://a:1,http://b:2"]) == {
        "gw": ("http://g:1",), "rr": ("http://a:1", "http://b:2")}
    for bad in (["http://g:1"], ["=http://g:1"], ["a=http://x:1", "a=http://y:1"]):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_locust_command_runs_the_packaged_locustfile_headless_with_a_safety_limit() -> None:
    """The subprocess is `python -m locust -f <packaged locustfile> --headless` with CSVs and a run-time cap."""
    argv = locust_command(_config(hosts=("http://a:1", "http://b:2"), drain_timeout=5.0), Path("/o"))
    assert argv[:5] == [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE)]
    assert LOCUSTFILE.is_file() and "--headless" in argv
    assert argv[argv.index("--hosts") + 1] == "http://a:1,http://b:2"
    assert argv[argv.index("--csv") + 1] == "/o/locust"
    assert argv[argv.index("-t") + 1] == "95s"  # 60 s schedule + 5 s drain + 30 s margin


def test_cli_user_mistakes_exit_2_with_the_value_and_no_traceback(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """A bad value on the command line exits 2 with a one-line message naming it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--host", "http://a:1", "--model", "m", "--rate", "-3", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "rate -3.0 must be > 0" in err and "Traceback" not in err


def test_cli_dry_run_prints_the_schedule_and_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--dry-run prints the request count and the locust command and runs nothing."""
    main_args = ["run", "--host", "http://a:1", "--model", "m", "--arrival", "burst", "--rate", "0",
                 "--burst-size", "5", "--burst-period", "10", "--duration", "30", "--out", str(tmp_path), "--dry-run"]
    with pytest.raises(SystemExit) as exit_info:
        main(main_args)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert out.startswith("10 requests over 30 s (burst)") and "-m locust" in out
    assert not any(tmp_path.iterdir())


def test_compare_keeps_the_schedule_and_salts_the_prompts_per_target(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    """compare runs each target with the same options but its own prompt salt (no shared prefix-cache hits)."""
    with pytest.raises(SystemExit):
        main(["compare", "--target", "gw=http://g:1", "--target", "rr=http://a:1,http://b:2", "--model", "m",
              "--rate", "2", "--duration", "10", "--seed", "4", "--out", str(tmp_path), "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if "-m locust" in line]
    n = len(poisson(2.0, 10.0, seed=4))
    assert lines[0].startswith(f"gw: {n} requests over 10 s") and lines[2].startswith(f"rr: {n} requests over 10 s")
    assert ["--prompt-salt=0" in commands[0], "--prompt-salt=1" in commands[1]] == [True, True]
    assert "--hosts http://a:1,http://b:2" in commands[1] and "--seed=4" in commands[1]


def test_the_cli_and_report_modules_do_not_import_locust_or_gevent() -> None:
    """Importing the CLI side leaves the interpreter un-patched: no locust, no gevent."""
    code = ("import sys, loadtest.cli, loadtest.report, loadtest.schedules, loadtest.workloads, loadtest.plots; "
            "print(sorted(m for m in ('locust', 'gevent', 'geventhttpclient') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                            check=True)
    assert result.stdout.strip() == "[]"
