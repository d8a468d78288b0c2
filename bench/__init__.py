"""Benchmarks: routing policies and replication on simulated replicas, and the gateway's overhead at scale.

Run each from the repository root: `python -m bench.routing`, `python -m bench.replication`,
`python -m bench.gateway_at_scale`. Each writes its results (JSON and a Markdown table) under docs/bench/ and its
plots under docs/figures/. `python -m bench.hostile` measures ordinary clients with and without an attack beside
them (`--json FILE` to keep the figures).
"""
