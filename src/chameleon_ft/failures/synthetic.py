"""Synthetic traces in the public formats ``chameleon trace import`` reads, for tests and
examples (the public traces themselves are not in this repository: docs/design.md 6).

- :func:`synthetic_node_faults`: a node-json fault trace shaped after the InfiniteHBD trace's
  published statistics (Shou et al., SIGCOMM'25; github.com/stepfun-ai/InfiniteHBD-Trace):
  400 servers of which 231 ever fault, 348 days, and its 584 faults with exactly the
  published counts per ``(Level, Class, Desc)`` (``fault_statistics.json``). What is not
  published as a statistic is our choice, said here: faults start uniformly over the
  period; a fault lands on one of the 231 nodes with weight ``1 / rank^0.8`` (every one at
  least once: a few nodes fault again and again, as in the file); a fault lasts a time
  log-normal with a median of 0.3 day and a log-spread of 1.8, clipped to 30 s .. 60 days
  (durations in the published file range from seconds to weeks).
- :func:`synthetic_straggler_ops`: per-operation timings in the columns of ByteDance's
  straggler traces (Lin et al., OSDI'25; github.com/ByteDance-Seed/StragglerAnalysis): a
  job of ``dp x pp`` workers (one rank each) whose worker ``slow_worker`` computes
  ``factor`` times slower during ``slow_steps``, with a few percent of noise everywhere.
"""

from __future__ import annotations

import csv
import io
import json
import math
import uuid

import numpy as np

INFINITEHBD_COUNTS: tuple[tuple[str, str, str, int], ...] = (
    ("Software Failure", "Other Failures", "Unknown Error", 12),
    ("Software Failure", "File System", "FS: Multiple Disk FS Error", 2),
    ("Software Failure", "File System", "FS Readonly", 1),
    ("Software Failure", "Software Tool", "Kubelet Date Absent", 7),
    ("Software Failure", "Operating System", "Kernel Panic", 1),
    ("Software Failure", "Firmware", "Firmware mismatch", 1),
    ("Hardware Failure", "GPU", "GPU DBE(Double Bit ECC) > Threshold", 60),
    ("Hardware Failure", "GPU", "GPU xid Error", 11),
    ("Hardware Failure", "GPU", "GPU Temperature High", 2),
    ("Hardware Failure", "GPU", "GPU Lost", 5),
    ("Hardware Failure", "GPU", "GPU device unknow error", 40),
    ("Hardware Failure", "GPU", "GPU PCI link width low", 25),
    ("Hardware Failure", "GPU", "nvidia-smi Timeout", 9),
    ("Hardware Failure", "GPU", "GPU SBE(Single Bit ECC) > Threshold", 1),
    ("Hardware Failure", "GPU", "GPU P2P Bandwidth Low", 3),
    ("Hardware Failure", "GPU", "Silent Data Corruption", 1),
    ("Hardware Failure", "GPU", "GPU device not found", 1),
    ("Hardware Failure", "Parameter Plane Cable", "Link Down", 40),
    ("Hardware Failure", "NIC", "NIC Link Speed low", 10),
    ("Hardware Failure", "NIC", "NIC Lost", 8),
    ("Hardware Failure", "NIC", "NIC PCI link Width low", 1),
    ("Hardware Failure", "NIC", "Rnic Gid Error", 11),
    ("Hardware Failure", "Power Supply", "Power Supply Failure detected", 25),
    ("Hardware Failure", "Power Supply", "Redundancy Lost", 1),
    ("Hardware Failure", "Fan", "Speed Critical (Sensor)", 31),
    ("Hardware Failure", "Fan", "Redundancy Lost", 2),
    ("Hardware Failure", "Motherboard Battery", "Low", 1),
    ("Hardware Failure", "Other Failures", "Unknown Error", 1),
    ("Hardware Failure", "Motherboard", "Motherboard Failed", 4),
    ("Hardware Failure", "CPU", "Configuration Error", 1),
    ("Hardware Failure", "CPU", "Machine Check Exception ( Uncorrectable )", 2),
    ("Hardware Failure", "RAID Card", "Bus Correctable error", 1),
    ("Hardware Failure", "Riser Card", "RiserCard Fault", 1),
    ("Other Failure", "Unknown Error", "Unknown Error", 144),
    ("Other Failure", "System Crash", "Server down", 1),
    ("Other Failure", "Stress Test Failure", "Unknown Error", 97),
    ("Other Failure", "Change", "Y-cables Taken offline", 3),
    ("Other Failure", "Change", "Remote Optical Module Failure", 1),
    ("Other Failure", "Training Task Troubleshooting", "Suspect Machine Offline", 14),
    ("Other Failure", "Test", "Temporarily Offline", 2),
)
"""The InfiniteHBD trace's faults per ``(Level, Class, Desc)``, as published (584)."""

NUM_SERVERS, FAULTY_SERVERS, DAYS = 400, 231, 348.0
"""The InfiniteHBD trace's servers, those that ever fault, and its days."""


def synthetic_node_faults(seed: int = 0) -> list[dict[str, object]]:
    """The node-json records of a synthetic InfiniteHBD-shaped trace (module docstring),
    sorted by time; ``seed`` fixes it."""
    rng = np.random.default_rng(seed)
    nodes = [str(uuid.UUID(int=int(rng.integers(2**63)) << 65 | int(rng.integers(2**63)),
                           version=4)) for _ in range(NUM_SERVERS)]
    causes = [c[:3] for c in INFINITEHBD_COUNTS for _ in range(c[3])]
    rng.shuffle(causes)
    weights = 1.0 / np.arange(1, FAULTY_SERVERS + 1) ** 0.8
    faulty = [int(i) for i in rng.permutation(NUM_SERVERS)[:FAULTY_SERVERS]]
    owner = faulty + [faulty[int(i)] for i in rng.choice(
        FAULTY_SERVERS, size=len(causes) - FAULTY_SERVERS, p=weights / weights.sum())]
    records: list[tuple[float, int, dict[str, object]]] = []
    for i, (level, cls, desc) in enumerate(causes):
        start = float(rng.uniform(0.0, DAYS))
        length = min(max(0.3 * math.exp(1.8 * float(rng.standard_normal())), 30 / 86400), 60.0)
        cause = {"Level": level, "Class": cls, "Desc": desc}
        for at, kind in ((start, "fault_start"), (start + length, "fault_end")):
            if at < DAYS:
                records.append((round(at, 4), len(records), {
                    "node_id": nodes[owner[i]], "event_time": round(at, 4),
                    "event_type": kind, "fault_type": cause}))
    return [record for _, _, record in sorted(records, key=lambda r: (r[0], r[1]))]


def node_faults_json(records: list[dict[str, object]]) -> str:
    """The records as the published file lays them out: a JSON list, one record a line."""
    return "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n"


STRAGGLER_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration",
                     "seq_id", "mc", "gmc", "mb_id")


def synthetic_straggler_ops(*, dp: int = 4, pp: int = 4, steps: int = 30,
                            microbatches: int = 2, slow_worker: tuple[int, int] = (1, 2),
                            slow_steps: range = range(10, 22), factor: float = 2.0,
                            seed: int = 0) -> str:
    """The CSV of a synthetic per-operation trace (module docstring): worker
    ``slow_worker`` = ``(dp_rank, stage)`` computes ``factor`` times slower during
    ``slow_steps``."""
    rng = np.random.default_rng(seed)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(STRAGGLER_COLUMNS)
    base = {"forward-compute": 0.010, "backward-compute": 0.020}
    for step in range(steps):
        for stage in range(pp):
            for d in range(dp):
                slow = factor if (d, stage) == slow_worker and step in slow_steps else 1.0
                clock = 0.0
                for mb in range(microbatches):
                    for optype, seconds in base.items():
                        duration = seconds * slow * float(rng.uniform(0.97, 1.03))
                        writer.writerow((d, stage, stage * dp + d, step, optype,
                                         f"{clock:.6f}", f"{duration:.6f}", mb, 0, stage, mb))
                        clock += duration
                writer.writerow((d, stage, stage * dp + d, step, "grads-reduce-scatter",
                                 f"{clock:.6f}", "0.005000", 0, 0, stage, ""))
    return out.getvalue()
