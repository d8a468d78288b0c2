"""Workload generators: lengths, prompts, ShareGPT parsing, mixes and seeding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.payload import request_body
from loadtest.workloads import (WORDS, EstimatedTokens, RequestSpec, WorkloadSpec, build_workload, estimate_tokens,
                                parse_sharegpt)


def _draw(spec: WorkloadSpec, n: int = 2000) -> list[RequestSpec]:
    workload = build_workload(spec)
    return [workload.request(i) for i in range(n)]


def test_fixed_default_is_the_papers_512_in_256_out() -> None:
    """The default workload asks 512 prompt tokens (512 words) and 256 output tokens."""
    requests = _draw(WorkloadSpec(), 20)
    assert {(r.prompt_tokens, r.max_tokens) for r in requests} == {(512, 256)}
    assert all(len(r.prompt.split()) == 512 and set(r.prompt.split()) <= set(WORDS) for r in requests)
    assert len({r.prompt for r in requests}) == 20  # distinct prompts: no accidental prefix caching


def test_requests_are_seeded_and_random_access() -> None:
    """Request i is the same whatever was asked before it, and another seed changes it."""
    a = build_workload(WorkloadSpec(kind="uniform", seed=3))
    b = build_workload(WorkloadSpec(kind="uniform", seed=3))
    c = build_workload(WorkloadSpec(kind="uniform", seed=4))
    assert a.request(17) == b.request(17)
    assert [a.request(i) for i in (5, 2, 9)] == [b.request(i) for i in (5, 2, 9)]
    assert a.request(17) != c.request(17)


def test_prompt_salt_changes_the_text_but_not_the_lengths(tmp_path: Path) -> None:
    """Another salt gives other prompt text with the same lengths (synthetic), or a distinct prefix (ShareGPT)."""
    plain = _draw(WorkloadSpec(kind="lognormal", seed=5), 50)
    salted = _draw(WorkloadSpec(kind="lognormal", seed=5, prompt_salt=2), 50)
    assert [(r.prompt_tokens, r.max_tokens) for r in plain] == [(r.prompt_tokens, r.max_tokens) for r in salted]
    assert all(a.prompt.split()[:3] != b.prompt.split()[:3] for a, b in zip(plain, salted))
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}]))
    assert build_workload(WorkloadSpec(kind="sharegpt", dataset=str(path), prompt_salt=3)).request(0).prompt == "(3) Hi"


def test_uniform_lengths_cover_the_range_around_the_mean() -> None:
    """Uniform lengths lie in [len*(1-r), len*(1+r)] and average len."""
    requests = _draw(WorkloadSpec(kind="uniform", input_len=200, output_len=100, range_ratio=0.5))
    inputs = np.array([r.prompt_tokens for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    assert inputs.min() >= 100 and inputs.max() <= 300 and outputs.min() >= 50 and outputs.max() <= 150
    assert inputs.mean() == pytest.approx(200, rel=0.03) and outputs.mean() == pytest.approx(100, rel=0.03)
    assert inputs.max() - inputs.min() > 180


def test_lognormal_lengths_have_the_given_median_and_spread() -> None:
    """Lognormal lengths have median len and log-standard-deviation sigma."""
    requests = _draw(WorkloadSpec(kind="lognormal", input_len=300, output_len=120, sigma=0.8))
    inputs = np.array([r.prompt_tokens for r in requests], dtype=float)
    assert np.median(inputs) == pytest.approx(300, rel=0.06)
    assert np.std(np.log(inputs)) == pytest.approx(0.8, rel=0.06)
    assert np.median([r.max_tokens for r in requests]) == pytest.approx(120, rel=0.06)


def test_mix_draws_long_requests_at_the_given_fraction() -> None:
    """A short/long mix has exactly the two shapes, long ones at long_fraction."""
    requests = _draw(WorkloadSpec(kind="mix", short=(64, 16), long=(1024, 256), long_fraction=0.25))
    shapes = [(r.prompt_tokens, r.max_tokens) for r in requests]
    assert set(shapes) == {(64, 16), (1024, 256)}
    assert shapes.count((1024, 256)) / len(shapes) == pytest.approx(0.25, abs=0.03)


def test_sharegpt_file_gives_first_human_turns_and_reply_lengths(tmp_path: Path) -> None:
    """ShareGPT conversations give the first human turn as prompt and the reply's length as output."""
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a GPU?"},
                                      {"from": "gpt", "value": "x" * 400}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"},
                                      {"from": "human", "value": "skipped"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Tell me more."},
                                      {"from": "gpt", "value": "y" * 40}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    workload = build_workload(WorkloadSpec(kind="sharegpt", dataset=str(path), seed=1))
    requests = [workload.request(i) for i in range(4)]
    assert {(r.prompt, r.max_tokens) for r in requests} == {("What is a GPU?", 100), ("Tell me more.", 10)}
    assert [r.prompt for r in requests[:2]] == [r.prompt for r in requests[2:]]  # cycles after the two usable
    fixed = build_workload(WorkloadSpec(kind="sharegpt", dataset=str(path), sharegpt_output_len=7))
    assert fixed.request(0).max_tokens == 7


def test_sharegpt_problems_are_named(tmp_path: Path) -> None:
    """A missing, non-JSON or empty dataset gives an error naming the file."""
    with pytest.raises(ValueError, match="cannot be read"):
        build_workload(WorkloadSpec(kind="sharegpt", dataset=str(tmp_path / "nope.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        build_workload(WorkloadSpec(kind="sharegpt", dataset=str(bad)))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        build_workload(WorkloadSpec(kind="sharegpt", dataset=str(empty)))
    with pytest.raises(ValueError, match="JSON list"):
        parse_sharegpt({"conversations": []}, EstimatedTokens())


def test_estimate_tokens_is_about_four_characters_each() -> None:
    """The tokenizer-free estimate is ceil(chars / 4), at least 1."""
    assert (estimate_tokens(""), estimate_tokens("abcd"), estimate_tokens("abcde")) == (1, 1, 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "zipf"}, "workload 'zipf'"),
    ({"input_len": 0}, "input_len 0"),
    ({"range_ratio": 1.0}, "range ratio 1.0"),
    ({"long_fraction": 1.5}, "long fraction 1.5"),
    ({"kind": "sharegpt"}, "needs a dataset"),
    ({"short": (0, 5)}, "lengths must be >= 1"),
    ({"prompt_salt": -1}, "prompt salt -1"),
])
def test_bad_workload_specs_name_the_bad_value(kwargs: dict, message: str) -> None:
    """Invalid workload parameters are refused with the value in the message."""
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**kwargs)


def test_request_bodies_stream_with_usage_for_both_endpoints() -> None:
    """Bodies stream, ask for usage, carry max_tokens and ignore_eos, as prompt or chat message."""
    request = RequestSpec(index=0, prompt="hello there", prompt_tokens=2, max_tokens=9)
    completion = request_body("m", "completions", request, ignore_eos=True)
    assert completion == {"model": "m", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
                          "temperature": 0.0, "ignore_eos": True, "prompt": "hello there"}
    chat = request_body("m", "chat", request, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}] and "ignore_eos" not in chat


def _train_tokenizer(path: Path) -> Path:
    """A small byte-level BPE tokenizer, trained here (words split into several tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 10, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_a_tokenizer_makes_prompt_lengths_exact(tmp_path: Path) -> None:
    """With the model's tokenizer, prompts have exactly the wanted number of tokens."""
    from tokenizers import Tokenizer

    directory = _train_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rough = build_workload(WorkloadSpec(kind="uniform", input_len=100, output_len=5)).request(3)
    assert len(tokenizer.encode(rough.prompt).ids) > 1.5 * rough.prompt_tokens  # words split into many tokens
    workload = build_workload(WorkloadSpec(kind="uniform", input_len=100, output_len=5, tokenizer=str(directory)))
    for i in range(20):
        request = workload.request(i)
        assert len(tokenizer.encode(request.prompt).ids) == request.prompt_tokens


def test_a_tokenizer_counts_sharegpt_lengths(tmp_path: Path) -> None:
    """ShareGPT prompt and reply lengths are counted with the tokenizer when one is given."""
    from tokenizers import Tokenizer

    directory = _train_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt, reply = "The lazy dog sleeps.", "The quick brown fox jumps over it."
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": prompt},
                                                   {"from": "gpt", "value": reply}]}]))
    request = build_workload(WorkloadSpec(kind="sharegpt", dataset=str(path),
                                          tokenizer=str(directory / "tokenizer.json"))).request(0)
    assert (request.prompt_tokens, request.max_tokens) == (len(tokenizer.encode(prompt).ids),
                                                           len(tokenizer.encode(reply).ids))


def test_an_unreadable_tokenizer_is_named(tmp_path: Path) -> None:
    """A tokenizer path that does not load gives an error naming it."""
    with pytest.raises(ValueError, match="tokenizer .* cannot be loaded"):
        build_workload(WorkloadSpec(tokenizer=str(tmp_path)))
