"""The real runtime: data x pipeline parallel training of a layered model on worker processes
over ``torch.distributed`` that survives killed, hung or failing workers in place.

- ``control``: the control plane, pure: the run's state, failure detection, recovery
  decisions and the step function that turns observations into effects;
- ``coordinator``: the shell around it: owns the store, launches and admits workers,
  gathers observations and performs the effects;
- ``worker``: a training process: group set-up, the schedule executor, migration;
- ``protocol``: the store keys and messages between the coordinator and the workers;
- ``storage``: layer state as bytes, checkpoints, the bulk-state channel;
- ``workload``: what the user hands over (models, data, optimizers), the API and the
  single-process reference trainer;
- ``report``: per-step records, failure events, transitions, metrics and plots;
- ``replay``: failure traces replayed on real workers;
- ``profiler``: per-layer costs, network and control latencies measured on this machine;
- ``chaos``: random faults for the chaos benchmark.

Importing this package does not import torch; its modules do.
"""
