"""Workloads: exact-length prompts with a tokenizer, approximate ones without, ShareGPT and JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from planner.errors import PlannerError
from planner.setup import WorkloadOptions, build_workload
from planner.workload import ApproximatePrompts, FixedLengths, TokenizerPrompts, load_jsonl, load_sharegpt


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer trained here (no download)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + ["hello world"] * 50,
                                  trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("n_tokens", [1, 32, 512])
def test_tokenizer_prompts_have_exactly_n_tokens_and_differ(tokenizer_file: Path, n_tokens: int) -> None:
    """Prompts built with the tokenizer encode back to exactly N tokens, and no two are alike."""
    builder = TokenizerPrompts(tokenizer_file)
    prompts = [builder.build(n_tokens, i) for i in range(5)]
    assert [builder.count(p) for p in prompts] == [n_tokens] * 5
    assert n_tokens == 1 or len(set(prompts)) == 5  # one random token may repeat; longer prompts do not


def test_approximate_prompts_have_n_words_and_a_unique_start() -> None:
    """Without a tokenizer: N words, starting with the request's index so no prefix is shared."""
    builder = ApproximatePrompts()
    prompts = [builder.build(20, i) for i in (0, 1)]
    assert [len(p.split()) for p in prompts] == [20, 20]
    assert prompts[0].split()[0] != prompts[1].split()[0]
    assert builder.count(prompts[0]) is None


def test_fixed_workload_defaults_to_the_papers_lengths(tokenizer_file: Path) -> None:
    """512 in, 256 out, ignore_eos; prompts come from the model directory's tokenizer.json."""
    workload = build_workload(WorkloadOptions(), str(tokenizer_file.parent))
    assert isinstance(workload, FixedLengths) and isinstance(workload.builder, TokenizerPrompts)
    requests = workload.requests(3, offset=100)
    assert all(r.max_tokens == 256 and r.ignore_eos for r in requests)
    assert workload.describe().tokens_per_request == 768


def test_sharegpt_takes_the_first_human_turn_and_the_reply_length(tmp_path: Path, tokenizer_file: Path) -> None:
    """Prompt = first turn; max_tokens = the reply's token count; malformed entries are skipped."""
    data = [{"conversations": [{"from": "human", "value": "hello world"},
                               {"from": "gpt", "value": "the quick brown fox"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"id": "no conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    builder = TokenizerPrompts(tokenizer_file)
    dataset = load_sharegpt(str(path), builder, default_output=99)
    assert [r.prompt for r in dataset.items] == ["hello world"]
    assert dataset.items[0].max_tokens == builder.count("the quick brown fox")
    assert dataset.describe().kind == "sharegpt" and dataset.describe().input_tokens == builder.count("hello world")
    assert [r.prompt for r in dataset.requests(3)] == ["hello world"] * 3  # cycled


def test_jsonl_takes_strings_or_objects(tmp_path: Path) -> None:
    """Each line is a prompt string or {"prompt", "max_tokens"}; the default output length fills gaps."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('"first prompt"\n\n{"prompt": "second", "max_tokens": 7}\n')
    dataset = load_jsonl(str(path), ApproximatePrompts(), default_output=32, ignore_eos=False)
    assert [(r.prompt, r.max_tokens, r.ignore_eos) for r in dataset.items] == [("first prompt", 32, False),
                                                                               ("second", 7, False)]
    assert dataset.describe().input_tokens is None  # no tokenizer: unknown, not guessed


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": 3}\n', "line 1: want a string"),
    ("not json\n", "line 1 is not valid JSON"),
    ("", "has no prompts"),
])
def test_bad_jsonl_is_named(tmp_path: Path, content: str, message: str) -> None:
    """A malformed JSONL names the file and line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(PlannerError, match=message):
        load_jsonl(str(path), ApproximatePrompts(), 16)


def test_missing_dataset_and_tokenizer_are_named(tmp_path: Path) -> None:
    """Unreadable files are user errors naming the path."""
    with pytest.raises(PlannerError, match="cannot read workload file"):
        build_workload(WorkloadOptions(dataset=str(tmp_path / "nope.json")), None)
    with pytest.raises(PlannerError, match="is not a tokenizer.json"):
        build_workload(WorkloadOptions(tokenizer=str(tmp_path / "nope")), None)


def test_sharegpt_without_a_tokenizer_estimates_reply_lengths(tmp_path: Path) -> None:
    """No tokenizer: reply lengths are estimated (four characters a token); prompt tokens stay unknown."""
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                   {"from": "gpt", "value": "x" * 40}]}]))
    dataset = load_sharegpt(str(path), ApproximatePrompts(), default_output=99)
    assert dataset.items[0].max_tokens == 10
    assert dataset.describe().input_tokens is None
