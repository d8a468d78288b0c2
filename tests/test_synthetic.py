"""Synthetic models: the shipped configs, the locally made tokenizer, and what the planner and the simulator make
of them (weights from the config, KV bytes from KV heads and head dim, the vocabulary's share of the sampler)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from planner import modelinfo
from planner.cli import main as planner_main
from sim.memory import MemoryModel
from sim.model import load_model
from synthetic import catalog
from synthetic.arch import config_path
from synthetic.build import ensure_synthetic_model, model_dir
from synthetic.verify import differences

REFERENCE = Path(__file__).resolve().parent.parent / "planner" / "data" / "bca-opt-1.3b-h100-single.csv"
# Sizes on the model cards (OPT: arXiv 2205.01068 Table 1); see synthetic/configs/SOURCES.md.
PUBLISHED_PARAMS = {"opt-125m": 125e6, "opt-1.3b": 1.3e9, "opt-2.7b": 2.7e9, "qwen3-0.6b": 0.6e9,
                    "qwen3-1.7b": 1.7e9, "llama-3.2-1b": 1.23e9, "llama-3.2-3b": 3.21e9, "gemma-3-1b": 1.0e9,
                    "smollm2-135m": 135e6}


def test_one_copy_of_each_config() -> None:
    """Every shipped name has exactly one config.json, in synthetic/configs; sim/configs is gone."""
    root = Path(__file__).resolve().parent.parent
    assert not (root / "sim" / "configs").exists()
    shipped = sorted(p.parent.name for p in (root / "synthetic" / "configs").glob("*/config.json"))
    assert shipped == catalog.names() and len(shipped) >= 6
    assert all(config_path(n) == config_path(f"synthetic:{n}") == catalog.entry(n).config_path for n in shipped)


@pytest.mark.parametrize("name", catalog.names())
def test_parameter_counts_match_the_model_cards(name: str) -> None:
    """The parameter count computed from each config.json is the published size (to 2%, cards round)."""
    spec = load_model(f"synthetic:{name}")
    assert spec.params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


def test_gqa_and_head_dim_set_the_kv_bytes() -> None:
    """KV bytes/token = 2 x 2 bytes x KV heads x head_dim x layers, in the simulator and the planner alike."""
    expected = {"qwen3-0.6b": 2 * 2 * 8 * 128 * 28, "llama-3.2-1b": 2 * 2 * 8 * 64 * 16,
                "gemma-3-1b": 2 * 2 * 1 * 256 * 26, "opt-1.3b": 2 * 2 * 2048 * 24}
    for name, kv in expected.items():
        assert load_model(name).kv_bytes_per_token == kv
        assert modelinfo.kv_bytes_per_token(f"synthetic:{name}") == kv


def test_tied_embeddings_are_counted_once() -> None:
    """Qwen3-0.6B ties its 151936 x 1024 embedding to the LM head: untying it adds exactly that matrix."""
    tied = load_model("qwen3-0.6b")
    untied_cfg = {**catalog.entry("qwen3-0.6b").config(), "tie_word_embeddings": False}
    from synthetic.arch import from_config
    untied = from_config(untied_cfg)
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert untied.params - tied.params == 151936 * 1024
    assert load_model("gemma-3-1b").tied_embeddings  # Gemma's config class ties unless told otherwise


def test_sampler_memory_scales_with_the_vocabulary() -> None:
    """The non-KV overhead grows with max_num_seqs x vocab: Gemma 3's 262k vocabulary costs 5.2x OPT's 50k."""
    memory = MemoryModel()
    opt, gemma = load_model("opt-1.3b"), load_model("gemma-3-1b")
    extra = [memory.overhead_bytes(m, 256) - memory.overhead_bytes(m, 0) for m in (opt, gemma)]
    assert extra[1] / extra[0] == pytest.approx(262144 / 50272)
    computed = modelinfo.non_kv_bytes("synthetic:gemma-3-1b", 256)
    assert computed is not None and computed[0] == int(memory.overhead_bytes(gemma, 256))
    assert "vocab 262,144" in computed[1]


@pytest.mark.parametrize("name", catalog.names())
def test_special_tokens_agree_with_the_config(name: str) -> None:
    """bos/eos/pad ids in config.json are the ids of the tokenizer's bos/eos/pad tokens."""
    item = catalog.entry(name)
    config, ids = item.config(), item.special_tokens_by_text()
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    assert ids[item.eos] in eos and config["bos_token_id"] == ids[item.bos]
    if "pad_token_id" in config:
        assert config["pad_token_id"] == ids[item.pad]


@pytest.mark.parametrize("name", ["opt-125m", "qwen3-0.6b", "llama-3.2-1b", "gemma-3-1b"])
def test_tokenizer_has_exactly_the_real_vocabulary(name: str, tmp_path: Path) -> None:
    """tokenizer.json holds exactly vocab_size ids, specials at their ids, every id decodes, text round-trips."""
    from tokenizers import Tokenizer

    path = ensure_synthetic_model(name, tmp_path)
    config = json.loads((path / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    item = catalog.entry(name)
    assert all(tokenizer.token_to_id(t) == i for i, t in item.special_tokens.items())
    assert tokenizer.decode([config["vocab_size"] - 1]) == f"<synthetic_{config['vocab_size'] - 1}>"
    text = "Hello, world! Ünïcode ☃"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (ids[0] == config["bos_token_id"]) is item.add_bos
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == item.eos and "{{" in tokenizer_config["chat_template"]


def test_transformers_loads_the_tokenizer_and_its_chat_template(tmp_path: Path) -> None:
    """What vLLM does with the directory: AutoTokenizer loads it, the chat template renders in the family's format."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_synthetic_model("qwen3-0.6b", tmp_path))
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == 151645
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_model_directory_is_cached_and_named_after_its_inputs(tmp_path: Path) -> None:
    """The second call reuses the directory (no rewrite); another config would get another directory."""
    first = ensure_synthetic_model("smollm2-135m", tmp_path)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert ensure_synthetic_model("synthetic:smollm2-135m", tmp_path) == first == model_dir("smollm2-135m", tmp_path)
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert not list(first.glob("*.safetensors")) and model_dir("opt-125m", tmp_path) != first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch directory left behind


def test_unknown_synthetic_name_lists_the_shipped_ones() -> None:
    with pytest.raises(catalog.UnknownModel, match="shipped: gemma-3-1b, .*opt-1.3b"):
        catalog.entry("synthetic:gpt-5")


def test_verify_reports_differences_and_ignores_tooling_keys() -> None:
    ours = catalog.entry("qwen3-0.6b").config()
    assert differences(ours, {**ours, "transformers_version": "9"}) == []
    assert differences(ours, {**ours, "num_key_value_heads": 4}) == ["num_key_value_heads: 8 != 4"]


@pytest.mark.parametrize(("name", "vocab"), [("opt-1.3b", 50272), ("qwen3-1.7b", 151936)])
def test_planner_plans_a_gpu_deployment_for_a_synthetic_model(name: str, vocab: int, tmp_path: Path) -> None:
    """`planner plan --model synthetic:NAME`: weights from the config, KV from KV heads x head dim, the
    sampler's vocabulary share in the overhead; no flag for any of them."""
    out = tmp_path / "plan.yaml"
    assert planner_main(["plan", "--profile", str(REFERENCE), "--model", f"synthetic:{name}", "--out", str(out),
                         "--gpu-memory-gib", "80", "--tokens-per-request", "384"]) == 0
    plan = yaml.safe_load(out.read_text())
    memory, spec = plan["reasoning"]["memory"], load_model(name)
    assert memory["weights_bytes"] == spec.weight_bytes
    assert memory["sources"]["weights"].startswith("the model's config.json")
    assert memory["kv_bytes"] == 256 * 384 * spec.kv_bytes_per_token
    assert memory["overhead_bytes"] == int(MemoryModel().overhead_bytes(spec, 256))
    assert f"vocab {vocab:,}" in memory["sources"]["overhead"]
    assert all(r["model"] == f"synthetic:{name}" for r in plan["replicas"])
    assert len(plan["replicas"]) == plan["reasoning"]["layout"]["replicas"] >= 1
