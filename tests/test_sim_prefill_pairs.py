"""A calibrated replica's prefill priced by the attention it computes: `prefill_s_per_pair` (measured by
`bench.prefill_cost`, taken by `sim calibrate --prefill-cost`), so a prompt's uncached end costs more after a long
cached context, as on vLLM-CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from sim.clock import VirtualClock
from sim.device import SharedDevice
from sim.engine import FINISHED, Engine, SimRequest
from sim.fromprofile import CalibrationError, prefill_pair_cost
from sim.measured import ConfigError, MeasuredStepTime, ReplicaModel
from sim.node import MeasuredSpec
from sim.workload import block_hashes

BASE = ReplicaModel(model_name="m", step_s=((1, 0.007), (4, 0.0085), (16, 0.0146), (32, 0.0223)),
                    prefill_s_per_token=80e-6, frontend_s=0.012, max_num_seqs=32, max_num_batched_tokens=2048,
                    chunked_prefill=True, prefix_caching=True, block_size=16, num_blocks=2048, max_model_len=2048,
                    step_context=300.0, long_step_s=((1, 0.010), (32, 0.032)), long_context=1200.0)
PAIRED = replace(BASE, prefill_s_per_pair=50e-9)


def test_a_chunk_pays_for_its_pairs_and_the_decoding_context_leaves_the_chunk_out() -> None:
    """4 sequences decoding at 1,000 tokens each beside a 100-token chunk after 600 cached: the chunk's 100 tokens
    and its 100 x (600 + 50) pairs, and the decoding step at 1,000 tokens of context (not (4,000 + 600) / 4)."""
    cost = MeasuredStepTime(PAIRED)
    decode = BASE.step(4, 1000.0) - BASE.step(4)
    got = cost.device_s(104, 4, 4000.0 + 600, 4000.0 + 100 * 650, decode_kv=4000.0)
    assert got == pytest.approx(100 * 80e-6 + 100 * 650 * 50e-9 + decode)
    assert MeasuredStepTime(BASE).device_s(104, 4, 4600.0, 4000.0 + 100 * 650, decode_kv=4000.0) == pytest.approx(
        100 * 80e-6 + decode)  # no pair cost measured: the tokens alone
    # a caller that does not split the decoding part out (a roofline's): as before, the pairs not priced
    assert cost.device_s(104, 4, 4600.0, 4600.0) == pytest.approx(100 * 80e-6 + BASE.step(4, 1150.0) - BASE.step(4))
    with pytest.raises(ConfigError, match="prefill_s_per_pair"):
        replace(BASE, prefill_s_per_pair=-1e-9)
    assert ReplicaModel.from_dict(json.loads(PAIRED.to_json())) == PAIRED


def first_token_s(model: ReplicaModel, cached: int, new: int) -> float:
    """Seconds from arrival to the first token of a prompt of `new` tokens after `cached` the engine has just
    served (a prompt of those `cached` tokens sent first), on an idle simulated replica."""
    clock = VirtualClock()
    eng = Engine(MeasuredSpec(model).engine_config(), MeasuredStepTime(model), SharedDevice(clock), clock)
    if cached:
        eng.add(SimRequest(cached, 1, blocks=block_hashes([(1, cached)], 16)))
        clock.run()
    req = SimRequest(cached + new, 1, blocks=block_hashes([(1, cached), (2, new)], 16))
    start = clock.now()
    eng.add(req)
    clock.run()
    assert req.state == FINISHED and req.first_token_at is not None and req.cached_tokens == cached
    return req.first_token_at - start


def test_a_turn_after_a_long_cached_history_prefills_slower_than_the_same_tokens_alone() -> None:
    """256 new tokens after 1,024 cached against 256 alone: 256 x 1,024 pairs more, about 13 ms at 50 ns a pair;
    without a pair cost the cached history is free."""
    alone, after = first_token_s(PAIRED, 0, 256), first_token_s(PAIRED, 1024, 256)
    assert after - alone == pytest.approx(256 * 1024 * 50e-9, rel=0.01)
    assert first_token_s(BASE, 1024, 256) == pytest.approx(first_token_s(BASE, 0, 256), rel=1e-6)


def test_the_prefill_cost_file_is_read_or_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps({"fit": {"base_s": 0.004, "per_token_s": 1.5e-4, "per_pair_s": 6e-8}}))
    assert prefill_pair_cost(path) == 6e-8
    for body, match in (("{", "is not JSON"), (json.dumps({"fit": {}}), "has no fit.per_pair_s"),
                        (json.dumps({"fit": {"per_pair_s": -1e-9}}), "measure it again")):
        path.write_text(body)
        with pytest.raises(CalibrationError, match=match):
            prefill_pair_cost(path)
    with pytest.raises(CalibrationError, match="cannot read"):
        prefill_pair_cost(tmp_path / "none.json")


def test_calibrate_takes_the_measured_pair_cost_and_fits_the_rest_per_token(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile of a replica whose 256-token prompts pay 60 ns a pair: given that cost, the fit keeps it and
    says where it came from; `sim calibrate --prefill-cost` with a bad file is a usage error naming it."""
    from sim.cli import main as sim_main
    from sim.fromprofile import calibrate
    from tests.test_sim_fromprofile import FACTS, TRUE, write_profile

    truth = replace(TRUE, prefill_s_per_pair=60e-9)
    write_profile(tmp_path / "p", truth)
    cost = tmp_path / "prefill.json"
    cost.write_text(json.dumps({"fit": {"per_pair_s": 60e-9}}))
    fitted, _ = calibrate(tmp_path / "p", FACTS, iters=5, prefill_cost=cost)
    assert fitted.prefill_s_per_pair == 60e-9 and str(cost) in fitted.source["prefill_s_per_pair"]
    cost.write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        sim_main(["calibrate", "--profile", str(tmp_path / "p"), "--out", str(tmp_path / "m.json"),
                  "--max-num-seqs", "32", "--max-num-batched-tokens", "2048", "--chunked-prefill", "--prefix-caching",
                  "--max-model-len", "2048", "--prefill-cost", str(cost)])
    assert exit_.value.code == 2 and "has no fit.per_pair_s" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
