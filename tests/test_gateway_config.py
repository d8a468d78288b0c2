"""Configuration: YAML and flags, every bad value refused at start with a message naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import _parser, build_config
from gateway.config import ConfigError, from_mapping


def test_yaml_with_every_section(tmp_path: Path) -> None:
    """A full YAML config is read into frozen values."""
    path = tmp_path / "gw.yaml"
    path.write_text("""
port: 9000
policy: power_of_two
replicas:
  - http://a:8001/
  - {url: http://b:8002, weight: 2, max_requests: 64, max_outstanding_tokens: 50000}
discovery: [{name: vllm.svc, port: 8000, interval_s: 5}]
timeouts: {connect_s: 1, first_byte_s: 20, idle_s: 5}
queue: {max_size: 100, max_wait_s: 3}
tokenizers: {m: /tmp/tok}
api_keys: [k1]
""")
    config = build_config(_parser().parse_args(["serve", "--config", str(path), "--port", "9100"]))
    assert config.port == 9100  # the flag wins
    assert [r.url for r in config.replicas] == ["http://a:8001", "http://b:8002"]
    assert config.replicas[1].max_requests == 64 and config.replicas[1].weight == 2
    assert config.discovery[0].name == "vllm.svc" and config.queue.max_size == 100
    assert config.tokenizer_map() == {"m": "/tmp/tok"} and config.api_keys == ("k1",)


@pytest.mark.parametrize(("data", "named"), [
    ({"replicas": ["ftp://x"]}, "ftp://x"),
    ({"replicas": ["http://a:1"], "policy": "fastest"}, "fastest"),
    ({"replicas": ["http://a:1"], "timeouts": {"idle_s": 0}}, "timeouts.idle_s"),
    ({"replicas": ["http://a:1"], "timeouts": {"idle": 3}}, "idle"),
    ({"replicas": ["http://a:1"], "queue": {"max_size": -1}}, "queue.max_size"),
    ({"replicas": ["http://a:1"], "retry": {"max_attempts": 0}}, "retry.max_attempts"),
    ({"replicas": [{"url": "http://a:1", "weight": -2}]}, "weight"),
    ({"replicas": [{"url": "http://a:1", "max_requests": 1.5}]}, "max_requests"),
    ({"replicas": ["http://a:1", "http://a:1/"]}, "twice"),
    ({"replicas": ["http://a:1"], "bogus": 1}, "bogus"),
    ({"replicas": ["http://a:1"], "port": 70000}, "port"),
    ({"discovery": [{"name": "x", "port": 0}]}, "port"),
    ({}, "no replicas"),
    ({"replicas": [{"url": "http://a:1", "max_num_seqs": 0}]}, "max_num_seqs"),
    ({"replicas": [{"url": "http://a:1", "speed": {"step_s": {1: -0.01}}}]}, "speed.step_s seconds"),
    ({"replicas": [{"url": "http://a:1", "speed": {"step_s": {"one": 0.01}}}]}, "batch size 'one'"),
    ({"replicas": [{"url": "http://a:1", "speed": {"prefill_tokens_s": 0}}]}, "prefill_tokens_s"),
    ({"replicas": [{"url": "http://a:1", "speed": {"fast": True}}]}, "fast"),
    ({"replicas": [{"url": "http://a:1", "speed": [1, 2]}]}, "speed must be a mapping"),
])
def test_bad_values_are_named(data: dict[str, object], named: str) -> None:
    """Each bad value is refused with a message naming it."""
    with pytest.raises(ConfigError, match=named):
        from_mapping(data)


def test_cli_refuses_bad_config_without_a_traceback(tmp_path: Path) -> None:
    """`gateway serve` with a bad value exits 2 and says what is wrong, in one line."""
    path = tmp_path / "gw.yaml"
    path.write_text("replicas: [http://a:1]\nhealth: {interval_s: -1}\n")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "health.interval_s" in result.stderr and "Traceback" not in result.stderr


def test_workers_and_feedback_settings() -> None:
    """`workers` takes a count or auto (the CPUs available); feedback is off unless enabled; bad values are named."""
    from gateway.config import cpu_count

    base = {"replicas": ["http://a:1"]}
    assert from_mapping(base).workers == 1 and not from_mapping(base).feedback.enabled
    assert from_mapping({**base, "workers": "auto"}).workers == cpu_count() >= 1
    assert from_mapping({**base, "workers": "3"}).workers == 3
    config = from_mapping({**base, "feedback": {"enabled": True, "interval_s": 0.25}})
    assert config.feedback.enabled and config.feedback.interval_s == 0.25
    for bad, name in (({"workers": 0}, "workers"), ({"workers": "many"}, "workers"),
                      ({"feedback": {"enabled": "yes"}}, "feedback.enabled"),
                      ({"feedback": {"interval_s": 0}}, "feedback.interval_s"),
                      ({"feedback": {"every": 1}}, "every")):
        with pytest.raises(ConfigError, match=name):
            from_mapping({**base, **bad})


def test_the_config_survives_the_trip_to_a_worker() -> None:
    """The supervisor hands its workers the config as plain data: it reads back equal."""
    from gateway.config import to_mapping

    config = from_mapping({"replicas": ["http://a:1", {"url": "http://b:2", "weight": 2.0, "max_requests": 4,
                                                       "max_num_seqs": 8, "speed": {"step_s": {1: 0.01, 8: 0.02}}}],
                           "discovery": [{"name": "vllm.svc", "port": 8000}], "tokenizers": {"m": "/t"},
                           "api_keys": ["k"], "workers": 2, "feedback": {"enabled": True}})
    assert from_mapping(json.loads(json.dumps(to_mapping(config)))) == config


def test_batch_cap_and_speed_per_replica_and_the_default_policy() -> None:
    """max_num_seqs and a measured speed (batch sizes as YAML writes them) reach the replica; the default policy is
    prefix_affinity."""
    config = from_mapping({"replicas": [{"url": "http://a:1", "max_num_seqs": 64,
                                         "speed": {"step_s": {"1": 0.004, 64: 0.012}, "prefill_tokens_s": 1e5}}],
                           "discovery": [{"name": "x", "max_num_seqs": 32}]})
    replica = config.replicas[0]
    assert replica.max_num_seqs == 64 and replica.speed is not None
    assert replica.speed.step(1) == 0.004 and replica.speed.step(64) == 0.012
    assert replica.speed.step(32) == pytest.approx(0.004 + 0.008 * 31 / 63)
    assert replica.speed.step(128) == pytest.approx(0.012 + 0.008 / 63 * 64)  # past the last point: its slope
    assert config.discovery[0].max_num_seqs == 32
    assert config.policy == "prefix_affinity"
