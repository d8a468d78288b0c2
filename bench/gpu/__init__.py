"""`python -m bench.gpu_replication`: the replication experiment of the papers, end to end, on one GPU.

- `settings`: what to measure and the time budget (the `gpu` and `quick` presets).
- `store`: one JSON file per measured point; a point on disk is not measured again.
- `cluster`: vLLM replicas (optionally under MPS) and gateways over them, from deploy's own parts.
- `steps`: frontier (+ the single-instance baseline), plan, replicas (+ routing), mps.
- `report`: PNG figures and a Markdown summary beside the papers' figures.
"""
