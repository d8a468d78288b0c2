"""The simulator's hardware and model facts: GPU table, config.json shapes, KV sizing, step-time roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.gpus import GIB, GPUS, get_gpu, parse_gpu_spec
from sim.memory import num_gpu_blocks
from sim.model import from_config, load_model
from sim.steptime import StepTimeModel


def test_gpu_table_has_the_required_gpus() -> None:
    """A100 40 GB, H100 64 and 80 GB, H200 and L4 are in the table with plausible figures."""
    for name in ("A100-40GB", "H100-64GB", "H100-80GB", "H200", "L4"):
        gpu = get_gpu(name)
        assert 16 * GIB <= gpu.memory_bytes <= 160 * GIB
        assert 0.2e12 <= gpu.bandwidth_bps <= 5e12 and 100e12 <= gpu.peak_flops <= 1000e12
    assert get_gpu("h100-80gb") is GPUS["H100-80GB"]


def test_gpu_spec_parses_and_names_bad_values() -> None:
    """--gpu-spec gives a custom GPU; a bad or missing value is named in the error."""
    gpu = parse_gpu_spec("name=L40S,memory_gib=48,bandwidth_gbps=864,tflops=181")
    assert (gpu.name, gpu.memory_bytes, gpu.bandwidth_bps, gpu.peak_flops) == ("L40S", 48 * GIB, 864e9, 181e12)
    with pytest.raises(ValueError, match="tflops='fast'"):
        parse_gpu_spec("memory_gib=48,bandwidth_gbps=864,tflops=fast")
    with pytest.raises(ValueError, match="lacks tflops"):
        parse_gpu_spec("memory_gib=48,bandwidth_gbps=864")
    with pytest.raises(ValueError, match="unknown GPU 'V100'"):
        get_gpu("V100")


@pytest.mark.parametrize(("name", "params", "hidden", "layers"), [
    ("opt-125m", 125.2e6, 768, 12), ("opt-1.3b", 1.316e9, 2048, 24), ("opt-2.7b", 2.652e9, 2560, 32)])
def test_shipped_opt_configs(name: str, params: float, hidden: int, layers: int) -> None:
    """Parameter counts match the published sizes; KV bytes/token = 2 x 2 x hidden x layers."""
    model = load_model(name)
    assert model.params == pytest.approx(params, rel=0.002)
    assert model.kv_bytes_per_token == 2 * 2 * hidden * layers
    assert model.max_model_len == 2048


def test_opt_1_3b_weights_are_2_45_gib() -> None:
    """The reference's 'weights about 2.45 GB in vLLM' for OPT-1.3B."""
    assert load_model("opt-1.3b").weight_bytes / GIB == pytest.approx(2.45, abs=0.01)


def test_config_from_a_directory_and_llama_shapes(tmp_path: Path) -> None:
    """A directory holding config.json works; a Llama config gets grouped-query KV and a gated MLP."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "_name_or_path": "llama-3-8b"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path))
    assert model.params == pytest.approx(8.03e9, rel=0.01)
    assert model.kv_bytes_per_token == 2 * 2 * 8 * 128 * 32
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        from_config({"model_type": "bert"})
    with pytest.raises(ValueError, match="no such config.json"):
        load_model(str(tmp_path / "missing"))


@pytest.mark.parametrize(("seqs", "util", "reference"), [(96, 0.9, 18525), (256, 0.9, 18446), (768, 0.9, 18135),
                                                          (256, 0.45, 8669), (96, 0.45, 8749), (96, 0.225, 3744)])
def test_kv_blocks_match_the_reference(seqs: int, util: float, reference: int) -> None:
    """KV blocks sized from the memory share are within 1.5% of what vLLM reported (two rows were fitted)."""
    blocks = num_gpu_blocks(load_model("opt-1.3b"), get_gpu("H100-64GB"), util, seqs)
    assert blocks == pytest.approx(reference, rel=0.015)


def test_a_model_too_big_for_its_share_is_refused() -> None:
    """OPT-2.7B in 0.05 of an L4 leaves no KV cache: the error says so."""
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        num_gpu_blocks(load_model("opt-2.7b"), get_gpu("L4"), 0.05, 256)


def test_decode_is_memory_bound_and_grows_with_batch_and_context() -> None:
    """A decode step costs at least the weights' read, and more with batch and with context."""
    model, gpu = load_model("opt-1.3b"), get_gpu("H100-80GB")
    st = StepTimeModel(model, gpu)
    weights_s = model.weight_read_bytes / gpu.bandwidth_bps
    assert st.decode_s(1, 100) > weights_s
    assert st.decode_s(64, 100) < st.decode_s(128, 100) < st.decode_s(128, 1000)
    # A 2048-token prefill is compute-bound: longer than its memory traffic alone.
    prefill = st.device_s(2048, 1, 0, 2048**2 / 2)
    memory = st.device_s(1, 1, 0, 0)
    assert prefill > 5 * memory
    assert st.host_s(256) > st.host_s(1) > 0
