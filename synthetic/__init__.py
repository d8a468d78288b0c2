"""Synthetic models: the real architecture (config.json), a locally made tokenizer of the real vocabulary size,
and no weights (vLLM serves them with `--load-format dummy`): a real model's speed and memory, nonsense output.

- `catalog`: the shipped architectures (`synthetic:NAME`), their config.json and special tokens.
- `arch`: a model's shape from its config.json (parameters, KV bytes per token, vocabulary).
- `build`: the model directory vLLM loads, made once into a cache (atomic).
"""
