"""``chameleon estimate``: the failure-free estimate of a job and, with ``--fail``, the
rerouted plan's estimate and the gap between them; with spare nodes (``[cluster]
spare_nodes``) also the swapped plan's (spare workers in the failed workers' places)."""

from __future__ import annotations

import argparse
from typing import Any

from chameleon_ft.cli.common import (
    check_workers,
    dumps,
    human_bytes,
    human_seconds,
    parse_workers,
    table,
)
from chameleon_ft.perf import Estimate, Topology, estimate
from chameleon_ft.plan import ExecutionPlan, initial_plan
from chameleon_ft.plan.reroute import reroute_plan
from chameleon_ft.profile import Profile, build_profile
from chameleon_ft.recovery.swap import swap_plan
from chameleon_ft.spec import load_config
from chameleon_ft.spec.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon estimate``."""
    parser.add_argument("--config", required=True, metavar="FILE.toml", help="job file")
    parser.add_argument("--fail", metavar="W[,W...]",
                        help="failed worker ids: also estimate the rerouted plan (and, with "
                             "spare nodes, the swapped one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rows(label: str, est: Estimate) -> list[str]:
    b = est.breakdown
    return [
        label,
        human_seconds(est.step_s),
        f"{est.throughput_samples_s:.4g}",
        f"{est.throughput_tokens_s:.4g}" if est.throughput_tokens_s else "-",
        f"{est.bubble_fraction:.1%}",
        human_bytes(est.max_memory_bytes),
        "yes" if est.memory_fits else "NO",
        f"{human_seconds(b.compute_s)} / {human_seconds(b.p2p_s)} / "
        f"{human_seconds(b.allreduce_s)} / {human_seconds(b.optimizer_s)}",
    ]


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    config = load_config(args.config)
    failed = parse_workers(args.fail) if args.fail else []
    check_workers(failed, config.num_workers)
    profile = build_profile(config)
    topology = Topology.from_config(config)
    plan = initial_plan(config, profile)
    base = estimate(plan, profile, topology)
    doc: dict[str, Any] = base.to_dict()
    doc["num_workers"] = len(plan.workers)
    rerouted = None
    if failed:
        rerouted_plan = reroute_plan(plan, failed)
        rerouted = estimate(rerouted_plan, profile, topology)
        doc["rerouted"] = rerouted.to_dict()
        doc["rerouted"]["failed"] = failed
        doc["rerouted"]["gap"] = 1 - rerouted.throughput_samples_s / base.throughput_samples_s
    swapped = None
    if failed and config.cluster.spare_nodes:
        swapped, doc["swapped"] = _swapped(config, plan, profile, topology, failed, base)
    if args.json:
        print(dumps(doc))
    else:
        _print_report(config, profile, doc, (base, rerouted, swapped), failed)
    return 0


def _swapped(config: Config, plan: ExecutionPlan, profile: Profile, topology: Topology,
             failed: list[int], base: Estimate) -> tuple[Estimate | None, dict[str, Any]]:
    """The swapped plan's estimate (spare workers in the failed workers' places) and its
    report, or ``None`` and why when the spares are too few."""
    alive = set(range(config.total_workers)) - set(failed)
    swapped_plan = swap_plan(plan, alive, topology)
    if swapped_plan is None:
        return None, {"failed": failed, "feasible": False,
                      "reason": f"{len(failed)} failed, {config.num_spare_workers} "
                                "spare workers"}
    swapped = estimate(swapped_plan, profile, topology)
    doc = swapped.to_dict()
    doc.update(
        failed=failed, feasible=True,
        spares=[st.worker for _, _, st in swapped_plan.iter_stages()
                if st.worker >= config.num_workers],
        gap=1 - swapped.throughput_samples_s / base.throughput_samples_s)
    return swapped, doc


def _print_report(config: Config, profile: Profile, doc: dict[str, Any],
                  estimates: tuple[Estimate, Estimate | None, Estimate | None],
                  failed: list[int]) -> None:
    """The report for people: the job, a table of the failure-free, rerouted and swapped
    estimates, and the gaps."""
    base, rerouted, swapped = estimates
    job = config.job
    model = config.model.name if config.model else f"{profile.num_layers} uniform layers"
    print(f"{model} on {config.cluster.num_nodes} x {config.cluster.devices_per_node} "
          f"{config.cluster.device.name if config.cluster.device else 'devices'}"
          + (f" + {config.cluster.spare_nodes} spare node(s)" if config.cluster.spare_nodes
             else "") + ": "
          f"tp {job.tp} x pp {job.pp} x dp {job.dp}, global batch {job.global_batch}, "
          f"micro-batch {job.micro_batch}, {job.schedule}"
          + (f" ({job.virtual_stages} chunks per worker)" if job.virtual_stages > 1 else ""))
    header = ["plan", "step", "samples/s", "tokens/s", "bubble", "peak mem/device", "fits",
              "compute / p2p / all-reduce / optimizer"]
    rows = [_rows("failure-free", base)]
    if rerouted is not None:
        rows.append(_rows(f"rerouted (fail {','.join(map(str, failed))})", rerouted))
    if swapped is not None:
        rows.append(_rows(f"swapped (spares {','.join(map(str, doc['swapped']['spares']))})",
                          swapped))
    print(table(rows, header))
    if rerouted is not None:
        print(f"gap: rerouted throughput is {doc['rerouted']['gap']:.2%} below failure-free")
    if swapped is not None:
        print(f"gap: swapped throughput is {doc['swapped']['gap']:.2%} below failure-free")
    elif "swapped" in doc:
        print(f"swap: not possible, {doc['swapped']['reason']}")
