"""The real runtime: data x pipeline parallel training of a tiny GPT on worker processes
over ``torch.distributed`` that survives killed, hung or failing workers in place.

- ``model``: the GPT cut into the planner's layers, AdamW with per-layer state;
- ``data``: the deterministic byte-level corpus (the standard library's sources);
- ``worker``: a training process following the coordinator's generations;
- ``coordinator``: the store owner: liveness, step commits, recovery via the policy;
- ``protocol``: the store keys and messages between them;
- ``profiler``: per-layer costs, network and control latencies measured on this machine.

Importing this package does not import torch; its modules do.
"""
