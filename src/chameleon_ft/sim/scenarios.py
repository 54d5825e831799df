"""Named scenarios: a job plus its failures, as the TOML a user could write.

Each preset is the text of a scenario file (``examples/scenarios/<name>.toml`` holds the
same text; a test keeps them equal): the job tables of ``chameleon estimate`` plus
``[simulation]`` and ``[failures]``. In every preset the ``[policy]`` prior (node MTBF,
repair time) matches the generated failures: an operator knows their fleet's rate roughly,
and Chameleon's horizon estimate starts from it and learns from the failures it sees.

- ``paper32``: the paper's 32-device setting (examples/paper32.toml's job), failures every
  few hours (node MTBF 12 h on 4 nodes: one every ~3 h) with repairs of hours.
- ``llama3-16k``: Llama 3 405B on 16,384 H100 (examples/llama3-405b-16k.toml's job) for
  54 days at Llama 3's published rate (419 interruptions in 54 days on 2,048 nodes) and mix;
  repairs by automated node replacement in 5 min to 2 h (docs/design.md, "Sources of the defaults").
- ``llama3-16k-slow``: ``llama3-16k`` with fail-slows (docs/design.md section 6): Falcon's
  durations (30 s to 10 h, log-uniform) and factors of 1.3x to 3x, at the rate that delays
  this job 1.34x when nobody answers them (Falcon's average job); the failures are those of
  ``llama3-16k``, seed for seed.
- ``llama3-64k``: the same job at 65,536 H100 (8,192 nodes, dp 512, 16 micro-batches per
  pipeline as at 16k) with the same per-node failure rate, mix and repairs: about 1,700
  interruptions in 54 days; the simulator's scale benchmark.
- ``spot``: the same 32 devices on preemptible nodes: whole-node preemptions every ~40 min
  for the job, nodes back after ~45 min on average, sometimes a zone-wide burst.
- ``sweep``: a grid over node MTBF (1 h to 30 days) and repair time (10 min to never) on a
  smaller job (GPT-3 1.3B, 2 nodes x 8 A100, pp 4 x dp 4) so 20 cells run in minutes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

from chameleon_ft.spec.config import Config, config_from_mapping
from chameleon_ft.spec.scenario import FailureSpec, SimulationSpec, scenario_specs

_PAPER32_JOB = """\
[model]
preset = "llama2-7b"

[cluster]
num_nodes = 4
devices_per_node = 8
device = "a100-80g"
intra_node_gb_per_s = 200.0
inter_node_gb_per_s = 25.0

[job]
tp = 1
pp = 4
dp = 8
global_batch = 256
micro_batch = 1
schedule = "1f1b"

[profile]
kind = "analytic"
recompute = "selective"

[recovery]
decoupled_backward = true        # peers can defer weight gradients (ReCycle)
detect_s = 30.0
restart_s = 600.0
checkpoint_load_s = 120.0
checkpoint_interval_s = 3600.0
"""

_LLAMA3_JOB = """\
[model]
preset = "llama3-405b"

[cluster]
num_nodes = {nodes}
devices_per_node = 8
device = "h100-80g"
intra_node_gb_per_s = 450.0
inter_node_gb_per_s = 50.0

[job]
tp = 8
pp = 16
dp = {dp}
global_batch = {batch}
micro_batch = 1
schedule = "interleaved"
virtual_stages = 8

[profile]
kind = "analytic"
recompute = "none"
shard_optimizer = true

[recovery]
decoupled_backward = true        # peers can defer weight gradients (ReCycle)
restart_s = 900.0
checkpoint_interval_s = 3600.0

[policy]
name = "chameleon"
repair_hours = 1.0

[simulation]
days = 54.0
seeds = 1
seed = 0

[failures]
interarrival = "exponential"
single_worker = 0.59
single_node = 0.18
multi_node = 0.08
software = 0.15
group_nodes = 4                 # nodes behind one leaf switch
repair = "uniform"
repair_min_hours = 0.0833       # automated node replacement: ~5 min
repair_max_hours = 2.0
"""
"""The Llama 3 405B job and its Llama 3 failures, at ``nodes`` 8-GPU nodes (one worker each),
``dp`` pipelines of 16 stages and 16 micro-batches of one sequence per pipeline."""

_LLAMA3_16K = """\
# Llama 3 405B on 16,384 H100 (examples/llama3-405b-16k.toml's job) for the 54 days of the
# Llama 3 report: 419 unexpected interruptions (node MTBF ~264 days), 59 % GPU-class, 18 %
# other host, 8 % switch or cable, 15 % software.
#
#   chameleon simulate --scenario llama3-16k

""" + _LLAMA3_JOB.format(nodes=2048, dp=128, batch=2048)

_LLAMA3_64K = """\
# The llama3-16k job at four times its scale: 65,536 H100 (8,192 nodes), dp 512 with the
# same 16 micro-batches per pipeline (a 64M-token step), at Llama 3's node failure rate
# (about 1,700 interruptions in 54 days) and mix. The simulator's scale benchmark.
#
#   chameleon simulate --scenario llama3-64k

""" + _LLAMA3_JOB.format(nodes=8192, dp=512, batch=8192)

_LLAMA3_16K_SLOW = """\
# llama3-16k with fail-slows: workers that keep running, slower. Falcon's study of a
# 10,000-GPU production cluster (arXiv:2410.12588) saw fail-slows last from tens of seconds
# to nearly ten hours and delay the average job 1.34x. Here they last 30 s to 10 h
# (log-uniform), slow a worker 1.3x to 3x, and start on a node once per 3,500 hours: the
# rate at which this job, left slow (--slow-policy keep), takes 1.34x as long as without
# them (docs/design.md section 6). The failures are those of llama3-16k, seed for seed.
#
#   chameleon simulate --scenario llama3-16k-slow
#   chameleon simulate --scenario llama3-16k-slow --slow-policy keep

""" + _LLAMA3_JOB.format(nodes=2048, dp=128, batch=2048) + """\
slow_node_mtbf_hours = 3500.0
slow_min_factor = 1.3
slow_max_factor = 3.0
"""

PRESETS: dict[str, str] = {
    "paper32": f"""\
# The Chameleon paper's 32-device setting (examples/paper32.toml's job) with failures every
# few hours and repairs of hours.
#
#   chameleon simulate --scenario paper32
#   chameleon simulate --config examples/scenarios/paper32.toml --seeds 5 --out out/paper32

{_PAPER32_JOB}
[policy]
name = "chameleon"
node_mtbf_hours = 12.0
repair_hours = 3.0

[simulation]
days = 7.0
seeds = 5
seed = 0

[failures]
node_mtbf_hours = 12.0          # 4 nodes: one interruption every ~3 h
interarrival = "exponential"
single_worker = 0.59            # Llama 3 mix: GPU-class faults
single_node = 0.18              # host faults
multi_node = 0.08               # switch / cable: both nodes of a pair
software = 0.15                 # job-level faults, no hardware lost
group_nodes = 2
repair = "exponential"
repair_hours = 3.0
""",
    "llama3-16k": _LLAMA3_16K,
    "llama3-16k-slow": _LLAMA3_16K_SLOW,
    "llama3-64k": _LLAMA3_64K,
    "spot": f"""\
# The 32 devices of paper32 on preemptible (spot) nodes: whole nodes are taken away every
# ~40 min for the job and come back after ~45 min on average; now and then a burst takes
# two nodes at once.
#
#   chameleon simulate --scenario spot

{_PAPER32_JOB}
[policy]
name = "chameleon"
node_mtbf_hours = 2.7
repair_hours = 0.75
node_failure_share = 1.0        # preemptions take whole nodes

[simulation]
days = 2.0
seeds = 20                      # policies differ by ~2% seed to seed: 5 cannot resolve 0.5%
seed = 0

[failures]
node_mtbf_hours = 2.7
interarrival = "weibull"        # preemptions come in bursts
weibull_shape = 0.7
single_worker = 0.0
single_node = 0.9
multi_node = 0.1
software = 0.0
group_nodes = 2
repair = "exponential"
repair_hours = 0.75
""",
    "sweep": """\
# Relative throughput of every policy over a grid of node MTBF (1 h .. 30 days) and repair
# time (10 min .. never), 12 seeds per cell, on a smaller job than paper32 so the 20 cells
# run in about a minute on 2 cores:
# GPT-3 1.3B on 2 nodes x 8 A100, 4 stages x 4 pipelines. Where failures are frequent
# one trace's relative throughput ranges over 4x: 3 seeds per cell cannot tell policies
# 0.5% apart there, 12 can.
#
#   chameleon simulate --scenario sweep --out out/sweep

[model]
preset = "gpt3-1.3b"

[cluster]
num_nodes = 2
devices_per_node = 8
device = "a100-80g"

[job]
tp = 1
pp = 4
dp = 4
global_batch = 128
micro_batch = 1

[profile]
kind = "analytic"
recompute = "selective"

[recovery]
decoupled_backward = true        # peers can defer weight gradients (ReCycle)
detect_s = 30.0
restart_s = 300.0
checkpoint_load_s = 60.0
checkpoint_interval_s = 3600.0

[policy]
name = "chameleon"

[simulation]
days = 3.0
seeds = 12
seed = 0
sweep_node_mtbf_hours = [1.0, 6.0, 24.0, 168.0, 720.0]
sweep_repair_hours = [0.1667, 2.0, 24.0, inf]

[failures]
single_worker = 0.59
single_node = 0.18
multi_node = 0.08
software = 0.15
group_nodes = 2
repair = "fixed"
""",
}
"""Scenario files by name."""


@dataclass(frozen=True)
class Scenario:
    """A job, what to simulate and how it fails."""

    name: str
    """Preset name or file stem."""
    config: Config
    """The job."""
    simulation: SimulationSpec
    """Duration, policies, seeds, sweep grid."""
    failures: FailureSpec
    """Failure rates, mix and repairs."""


def scenario_from_config(name: str, config: Config) -> Scenario:
    """A scenario from a loaded job file with ``[simulation]`` and ``[failures]`` tables.

    Raises:
        ValueError: naming the bad key of either table.
    """
    simulation, failures = scenario_specs(config.extra)
    return Scenario(name=name, config=config, simulation=simulation, failures=failures)


def preset_scenario(name: str) -> Scenario:
    """The named preset scenario.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"--scenario: unknown scenario {name!r}; choose one of "
                         f"{', '.join(PRESETS)}")
    config = config_from_mapping(tomllib.loads(PRESETS[name]))
    return scenario_from_config(name, config)
