"""A calibrated simulator of vLLM replicas sharing one GPU.

The parts, from the bottom up:

- `gpus`, `model`: what the hardware and the model are (a GPU table; a Hugging Face config.json).
- `memory`: how many 16-token KV blocks a replica gets from its share of GPU memory.
- `steptime`: how long one engine step takes (device part from a roofline, host part that does not use the GPU).
- `device`: one GPU shared by several replicas (their device parts time-share it; host parts overlap).
- `engine`: one replica's vLLM-like scheduler (batch cap, token budget, KV blocks, preemption, waiting queue).
- `clock`: the time the engine runs in: virtual (a discrete-event core, no sleeping) or an asyncio loop's.
- `workload`, `calibrate`: request mixes and arrival processes; the fit against the reference data.
- `fleet`: replicas of one GPU behind the gateway's real routing code, in virtual time.
- `server`, `cli`: `sim serve`, OpenAI-compatible replicas in real time.
"""
