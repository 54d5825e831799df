"""The real runtime: data x pipeline parallel training of a layered model on worker processes
over ``torch.distributed`` that survives killed, hung or failing workers in place.

- ``models``: the layered-model protocol and its adapters (the built-in GPT, Hugging Face
  Llama, a user's factory), ``load_model(config)``;
- ``datasets``: data sources by global sample position (bytes, token files, factories);
- ``optim``: any torch.optim optimizer per layer, its state as bytes, schedules;
- ``reference``: the plain single-process trainer the runtime's results are checked against;
- ``model``: the built-in GPT cut into the planner's layers;
- ``data``: the deterministic byte-level corpus (the standard library's sources);
- ``worker``: a training process following the coordinator's generations;
- ``coordinator``: the store owner: liveness, step commits, recovery via the policy;
- ``protocol``: the store keys and messages between them;
- ``profiler``: per-layer costs, network and control latencies measured on this machine.

Importing this package does not import torch; its modules do.
"""
