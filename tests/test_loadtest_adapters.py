"""The load test's LoRA workload: requests name adapters with Zipf popularity, seeded per request."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loadtest.config import config_from_options, make_parser, to_argv
from loadtest.payload import request_body
from loadtest.workloads import WorkloadSpec, build_workload, zipf_weights

ADAPTERS = ("a0", "a1", "a2", "a3")


def test_adapters_follow_zipf_and_the_seed() -> None:
    """4,000 requests over 4 adapters at s=1: shares near 1/k normalised; the same seed gives the same names."""
    workload = build_workload(WorkloadSpec(adapters=ADAPTERS, zipf_s=1.0, seed=3, input_len=4, output_len=2))
    names = [workload.request(i).model for i in range(4000)]
    shares = Counter(names)
    expected = zipf_weights(4, 1.0)
    assert expected == pytest.approx([0.48, 0.24, 0.16, 0.12], abs=0.001)
    for k, name in enumerate(ADAPTERS):
        assert shares[name] / 4000 == pytest.approx(expected[k], abs=0.03)
    again = build_workload(WorkloadSpec(adapters=ADAPTERS, zipf_s=1.0, seed=3, input_len=4, output_len=2))
    assert [again.request(i).model for i in (17, 5, 3999)] == [names[17], names[5], names[3999]]
    assert np.allclose(zipf_weights(3, 0.0), 1 / 3)


def test_the_body_names_the_adapter_and_plain_runs_are_unchanged() -> None:
    """A request with an adapter asks for it; without adapters the run's model is asked for."""
    with_adapter = build_workload(WorkloadSpec(adapters=ADAPTERS, input_len=4, output_len=2)).request(0)
    assert request_body("base", "completions", with_adapter, True)["model"] in ADAPTERS
    plain = build_workload(WorkloadSpec(input_len=4, output_len=2)).request(0)
    assert plain.model is None and request_body("base", "completions", plain, True)["model"] == "base"


def test_adapter_options_round_trip() -> None:
    """--adapters and --zipf survive to_argv and back (the locustfile gets them so)."""
    opts = make_parser().parse_args(["--model", "m", "--adapters", "a0,a1", "--zipf", "1.2"])
    config = config_from_options(opts, ("http://x:1",), None)
    assert config.workload.adapters == ("a0", "a1") and config.workload.zipf_s == 1.2
    again = config_from_options(make_parser().parse_args(to_argv(config)), ("http://x:1",), None)
    assert again == config
