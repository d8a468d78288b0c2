"""Pictures: PNGs are written for the reference CSV, a GPU profile (fake NVML numbers) and a validation."""

from __future__ import annotations

from pathlib import Path

from planner.cli import main
from planner.points import GpuSummary, Latency, Profile, ProfileContext, ProfilePoint
from planner.plots import plot_gpu, plot_profile

REFERENCE = Path(__file__).resolve().parent.parent / "planner" / "data" / "bca-opt-1.3b-h100-single.csv"


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_command_draws_the_reference_frontier(tmp_path: Path) -> None:
    """`planner plot` on the reference CSV writes frontier.png, and no gpu.png (nothing was measured)."""
    assert main(["plot", "--profile", str(REFERENCE), "--out", str(tmp_path)]) == 0
    assert is_png(tmp_path / "frontier.png")
    assert not (tmp_path / "gpu.png").exists()


def test_gpu_profile_gets_a_gpu_picture(tmp_path: Path) -> None:
    """When points carry NVML summaries, gpu.png is drawn beside frontier.png."""
    gpu = GpuSummary(name="Fake H100", memory_total_bytes=80 * 2**30, samples=10, utilization_mean_pct=60.0,
                     utilization_max_pct=90.0, memory_used_max_bytes=70 * 2**30, power_mean_w=300.0)
    points = tuple(ProfilePoint(batch_size=b, total_tok_s=t, gpu=gpu, preemptions=p, tpot_ms=Latency(mean=float(b)))
                   for b, t, p in ((8, 100.0, 0), (16, 180.0, 0), (32, 200.0, 0), (64, 260.0, 5)))
    written = plot_profile(Profile(points, ProfileContext(model="m")), tmp_path)
    assert [p.name for p in written] == ["frontier.png", "gpu.png"]
    assert all(is_png(p) for p in written)
    cpu_only = Profile((ProfilePoint(batch_size=1, total_tok_s=1.0),))
    assert plot_gpu(cpu_only, tmp_path / "none.png") is None
