"""`bench.way_out_probe`: the fit of a way out from two sides' probes, and the probe itself against SIMULATED
replicas (`sim serve --config`): a model given a way out reads back as that way out against the same model
without one. The real replica's figures are in docs/sim.md's notebook."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim_vs_real import main as sim_vs_real
from bench.sim_vs_real import resolved_way_out, serve_sim
from bench.way_out_probe import Outside, WayOut, fit_way_out, lines, load, probe_outside, record, save
from deploy.ports import free_ports
from sim.measured import ReplicaModel

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica_slowsteps_2026-11-29.json"


def side(outside_ms: dict[int, float]) -> list[Outside]:
    return [Outside(n, 30.0 + ms, 30.0) for n, ms in outside_ms.items()]


def test_the_way_out_is_the_line_through_real_less_simulated_and_never_below_zero(tmp_path: Path) -> None:
    sim = side({0: 2.0, 4: 2.5, 8: 2.0, 16: 3.0, 24: 2.5})
    real = side({n: s.outside_ms + 1.6 + 0.5 * n for n, s in zip((0, 4, 8, 16, 24), sim)})
    fit = fit_way_out(real, sim)
    assert fit.ms == pytest.approx(1.6) and fit.ms_per_stream == pytest.approx(0.5)
    assert fit.flag == "1.600,0.5000"
    # the real side no slower with more streams: no cost a stream, the mean gap
    assert fit_way_out(side({0: 5.0, 8: 4.0}), side({0: 2.0, 8: 2.0})) == WayOut(2.5, 0.0)
    # the real side faster alone: no base, the line through the origin
    flat = fit_way_out(side({0: 1.0, 8: 10.0}), side({0: 2.0, 8: 2.0}))
    assert flat.ms == 0.0 and flat.ms_per_stream == pytest.approx(1.0)
    assert fit_way_out(side({0: 1.0, 8: 1.0}), side({0: 2.0, 8: 2.0})) == WayOut(0.0, 0.0)
    with pytest.raises(ValueError, match="same two or more stream counts"):
        fit_way_out(side({0: 1.0, 8: 2.0}), side({0: 1.0, 4: 2.0}))
    with pytest.raises(ValueError, match="same two or more"):
        fit_way_out(side({0: 1.0}), side({0: 1.0}))
    save(tmp_path / "probe.json", real)
    assert load(tmp_path / "probe.json") == real
    text = "\n".join(lines(record(real, sim, fit), [{"background": 0, "client_ttft_ms": 34.0, "ttft_ms": 30.0}]))
    assert "**1.60 ms + 0.500 ms a stream**" in text and "| 24 | 46.1 | 16.1 | 2.5 |  |" in text
    assert "| 0 | 33.6 | 3.6 | 2.0 | 4.0 |" in text
    assert lines(None) == []


def test_a_model_given_a_way_out_probes_as_that_way_out_against_the_same_model_without(
        tmp_path: Path, tiny_tokenizer: str) -> None:
    """The plain calibration and the same with 8 ms + 1.5 ms a stream, each served alone and probed beside 0 and 8
    streams. The probe is a request of one token sent whole, so this also checks that such a response takes the
    way out once. The fit comes back within the event loop's noise (a few ms on this machine)."""
    given = tmp_path / "given.json"
    given.write_text(replace(ReplicaModel.load(MODEL), way_out_s=8e-3, way_out_per_stream_s=1.5e-3).to_json())
    probes = []
    for path in (given, MODEL):
        with ExitStack() as stack:
            urls, _ = serve_sim(stack, str(path), 1, free_ports(1), tmp_path / "sim.log", tiny_tokenizer)
            probes.append(probe_outside(urls[0], backgrounds=(0, 8), reps=3, window_s=0.1))
    with_way_out, plain = probes
    assert [p.background for p in plain] == [0, 8]
    assert all(p.outside_ms >= 0 for p in plain)
    fit = fit_way_out(with_way_out, plain)
    assert fit.ms == pytest.approx(8.0, abs=3.0)
    assert fit.ms_per_stream == pytest.approx(1.5, abs=0.6)


def test_sim_vs_real_probes_the_way_out_unless_told_and_names_the_format_otherwise(
        capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("1.6", "1.6,x", "-1,0.5", "measure"):
        with pytest.raises(SystemExit) as exc:
            sim_vs_real([f"--way-out={bad}", "--dry-run"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--way-out " in err and "(or probe, or none)" in err
    for good in ("probe", "1.6,0.5", "none"):
        sim_vs_real(["--way-out", good, "--dry-run", "--seeds", "1", "--workloads", "mix", "--chat-rates", ""])
        assert "runs of 15 s of schedule" in capsys.readouterr().out
    assert resolved_way_out(None, quick=False) == "probe" and resolved_way_out(None, quick=True) is None
    assert resolved_way_out("none", quick=False) is None and resolved_way_out("1.6,0.5", quick=True) == "1.6,0.5"
