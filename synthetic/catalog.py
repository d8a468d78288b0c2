"""The shipped architectures: `synthetic:NAME` -> the published config.json and the tokenizer's special tokens.

One copy of each config.json lives in `synthetic/configs/NAME/` (the simulator reads the same files); where each
value comes from is in `synthetic/configs/SOURCES.md`. The special tokens sit at the ids the real tokenizer gives
them, so `bos_token_id`, `eos_token_id` and `pad_token_id` in config.json name the same tokens here as there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "synthetic:"
CONFIG_DIR = Path(__file__).parent / "configs"

# Simplified chat templates in each family's format (the real ones also handle tools, system prompts, ...).
_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
           "\n\n{{ message['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
           "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_GEMMA = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
          "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] }}"
          "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_PLAIN = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant:{% endif %}")

_OPT_TOKENS = {0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>"}
_QWEN_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
_LLAMA_TOKENS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                 128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}
_GEMMA_TOKENS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>", 106: "<end_of_turn>"}
_SMOL_TOKENS = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}


class UnknownModel(ValueError):
    """A `synthetic:` name that is not shipped; the message lists the shipped ones."""


@dataclass(frozen=True)
class Entry:
    """One shipped architecture: where its config comes from and its tokenizer's special tokens."""

    name: str
    hub_id: str
    special_tokens: dict[int, str]
    bos: str
    eos: str
    pad: str
    chat_template: str
    unk: str | None = None
    add_bos: bool = False  # whether the real tokenizer puts the BOS token before every prompt

    @property
    def config_path(self) -> Path:
        return CONFIG_DIR / self.name / "config.json"

    def config(self) -> dict[str, Any]:
        data = json.loads(self.config_path.read_text())
        assert isinstance(data, dict)
        return data

    def special_tokens_by_text(self) -> dict[str, int]:
        return {text: i for i, text in self.special_tokens.items()}

    @property
    def served_name(self) -> str:
        """The name vLLM serves it as: says plainly that it is not the real model."""
        return f"synthetic-{self.name}"


ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry("opt-125m", "facebook/opt-125m", _OPT_TOKENS, "</s>", "</s>", "<pad>", _PLAIN, "<unk>", add_bos=True),
    Entry("opt-1.3b", "facebook/opt-1.3b", _OPT_TOKENS, "</s>", "</s>", "<pad>", _PLAIN, "<unk>", add_bos=True),
    Entry("opt-2.7b", "facebook/opt-2.7b", _OPT_TOKENS, "</s>", "</s>", "<pad>", _PLAIN, "<unk>", add_bos=True),
    Entry("qwen3-0.6b", "Qwen/Qwen3-0.6B", _QWEN_TOKENS, "<|endoftext|>", "<|im_end|>", "<|endoftext|>", _CHATML),
    Entry("qwen3-1.7b", "Qwen/Qwen3-1.7B", _QWEN_TOKENS, "<|endoftext|>", "<|im_end|>", "<|endoftext|>", _CHATML),
    Entry("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", _LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>",
          "<|end_of_text|>", _LLAMA3, add_bos=True),
    Entry("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", _LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>",
          "<|end_of_text|>", _LLAMA3, add_bos=True),
    Entry("gemma-3-1b", "google/gemma-3-1b-it", _GEMMA_TOKENS, "<bos>", "<eos>", "<pad>", _GEMMA, "<unk>", add_bos=True),
    Entry("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", _SMOL_TOKENS, "<|im_start|>", "<|im_end|>",
          "<|im_end|>", _CHATML),
)}


def names() -> list[str]:
    return sorted(ENTRIES)


def parse(model: str) -> str | None:
    """The NAME of `synthetic:NAME` (None: not a synthetic model)."""
    return model[len(PREFIX):].strip().lower() if model.startswith(PREFIX) else None


def is_synthetic(model: str | None) -> bool:
    return bool(model) and model is not None and model.startswith(PREFIX)


def entry(name: str) -> Entry:
    """The entry for NAME or `synthetic:NAME`; UnknownModel lists the shipped names."""
    key = parse(name) or name.strip().lower()
    if key not in ENTRIES:
        raise UnknownModel(f"no synthetic model {name!r}; shipped: {', '.join(names())}")
    return ENTRIES[key]
