"""``chameleon plan``: every recovery candidate for a failure (``--fail``) or a slow worker
(``--slow W:F``), priced, and the decision."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from chameleon_ft.cli.common import (
    check_workers,
    dumps,
    human_bytes,
    human_seconds,
    parse_workers,
    table,
)
from chameleon_ft.policy import Decision, Planner
from chameleon_ft.spec import load_config
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.recovery import POLICY_NAMES, SLOW_POLICY_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon plan``."""
    parser.add_argument("--config", required=True, metavar="FILE.toml", help="job file")
    event = parser.add_mutually_exclusive_group(required=True)
    event.add_argument("--fail", metavar="W[,W...]",
                       help="failed worker ids (of the job's failure-free plan)")
    event.add_argument("--slow", metavar="W:F",
                       help="worker W runs F times slower (a fail-slow): keep, rebalance, "
                            "dynamic, swap and evict priced")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--horizon-s", type=float, metavar="D",
                        help="time until the plan next changes (Eq. 8); default: estimated")
    window.add_argument("--node-mtbf-hours", type=float, metavar="H",
                        help="prior mean time between failures of one node, for the estimate")
    parser.add_argument("--policy", choices=[p for p in POLICY_NAMES],
                        help="chameleon (adaptive) or a fixed strategy; default: the config's")
    parser.add_argument("--slow-policy", choices=SLOW_POLICY_NAMES,
                        help="the answer to a slow worker: chameleon (the best score) or a "
                             "fixed one; default: the config's [recovery] slow_policy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def parse_slow(text: str) -> tuple[int, float]:
    """``"W:F"`` as a worker id and a factor.

    Raises:
        ValueError: naming ``--slow`` for anything but ``integer:number`` with a factor > 1.
    """
    worker_text, sep, factor_text = text.partition(":")
    try:
        if not sep or not worker_text.strip().isdigit():
            raise ValueError
        factor = float(factor_text)
    except ValueError:
        raise ValueError(f"--slow: {text!r} is not W:F; give a worker id and its slowdown, "
                         "such as 5:2.5") from None
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"--slow: the factor must be a number > 1 (F times slower), got "
                         f"{factor_text!r}")
    return int(worker_text), factor


def _terms_text(terms: Mapping[str, float]) -> str:
    """``name value`` for every transition term, in the model's order."""
    return ", ".join(f"{k} {human_seconds(v) if v else '0 s'}" for k, v in terms.items()) or "none"


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "-"


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status.

    Raises:
        ValueError: for bad flags or a failure nothing can recover from.
    """
    config = _config(args)
    slow: tuple[int, float] | None = None
    if args.slow is not None:
        slow = parse_slow(args.slow)
        failed = [slow[0]]
        check_workers(failed, config.num_workers, "--slow")
    else:
        failed = parse_workers(args.fail)
        check_workers(failed, config.num_workers)
    planner = Planner(config, policy=args.policy)
    everyone = range(config.total_workers)
    if slow is not None:
        # every worker is alive (the spares idle); the slow one runs at its factor
        decision = planner.decide_slow(planner.initial_plan, slow[0], slow[1], alive=everyone,
                                       horizon_s=args.horizon_s, slow_policy=args.slow_policy)
    else:
        # the spare nodes' workers are alive and idle: swap can put them in the failed places
        alive = [w for w in everyone if w not in set(failed)]
        decision = planner.decide(planner.initial_plan, failed, alive=alive,
                                  horizon_s=args.horizon_s)
    if args.json:
        print(dumps(_report(config, planner, decision, failed, slow)))
    else:
        _print_report(config, planner, decision, failed, slow)
    return 0


def _config(args: argparse.Namespace) -> Config:
    """The job file with the flags that change it (``--node-mtbf-hours``).

    Raises:
        ValueError: for a negative horizon or a node MTBF that is not a finite number > 0.
    """
    config = load_config(args.config)
    if args.horizon_s is not None and (math.isnan(args.horizon_s) or args.horizon_s < 0):
        raise ValueError(f"--horizon-s: must be >= 0, got {args.horizon_s}")
    if args.node_mtbf_hours is not None:
        if not args.node_mtbf_hours > 0 or math.isinf(args.node_mtbf_hours):
            raise ValueError(f"--node-mtbf-hours: must be a finite number > 0, got "
                             f"{args.node_mtbf_hours}")
        config = replace(config, policy=replace(config.policy,
                                                node_mtbf_hours=args.node_mtbf_hours))
    if args.slow_policy is not None:
        config = replace(config, recovery=replace(config.recovery,
                                                  slow_policy=args.slow_policy))
    return config


def _report(config: Config, planner: Planner, decision: Decision,
            failed: list[int], slow: tuple[int, float] | None) -> dict[str, Any]:
    """The ``--json`` report: the decision, every candidate, the failure-free figures
    (``slow`` and ``slow_policy`` for a slow worker instead of ``failed``)."""
    base = planner.failure_free
    doc = {
        "decision": {"strategy": decision.strategy, "reason": decision.reason,
                     "transition_s": decision.transition_s,
                     "horizon_s": decision.horizon_s,
                     "horizon_expected": decision.horizon_expected,
                     "cache_hit": decision.cache_hit,
                     "plan": decision.plan.to_dict(),
                     "migration": (decision.migration.to_dict()
                                   if decision.migration is not None else None)},
        "candidates": [c.to_dict() for c in decision.candidates],
        "failure_free": {"step_s": base.step_s,
                         "throughput_samples_s": base.throughput_samples_s},
        "failed": failed,
        "spare_workers": list(range(config.num_workers, config.total_workers)),
        "policy": planner.policy,
        "search_s": decision.search_s,
        "setup_s": planner.setup_s,
    }
    if slow is not None:
        del doc["failed"]
        doc["slow"] = {"worker": slow[0], "factor": slow[1]}
        doc["slow_policy"] = config.recovery.slow_policy
    return doc


def _print_report(config: Config, planner: Planner, decision: Decision,
                  failed: list[int], slow: tuple[int, float] | None) -> None:
    """The report for people: the job, the candidates' table, each one's transition
    terms, the decision."""
    base = planner.failure_free
    job = config.job
    spares = (f", {config.cluster.spare_nodes} spare node(s) ({config.num_spare_workers} "
              "idle workers)" if config.cluster.spare_nodes else "")
    print(f"failure-free: tp {job.tp} x pp {job.pp} x dp {job.dp}{spares}, step "
          f"{human_seconds(base.step_s)}, {base.throughput_samples_s:.4g} samples/s")
    horizon = ("expected " if decision.horizon_expected else "") + human_seconds(
        decision.horizon_s)
    event = (f"slow worker {slow[0]} at {slow[1]:g}x; slow policy "
             f"{config.recovery.slow_policy}" if slow is not None
             else f"failed workers: {','.join(map(str, failed))}")
    print(f"{event}; policy {planner.policy}; horizon {horizon}")
    header = ["strategy", "feasible", "step", "samples/s", "vs failure-free", "transition",
              "score", "peak mem/device", "why"]
    print(table(_candidate_rows(decision, base.throughput_samples_s), header))
    print("transition terms (s):")
    for c in decision.candidates:
        if not c.feasible:
            continue
        line = _terms_text(c.terms)
        if c.interim_step_s is not None:
            line += (f"; then {human_seconds(c.interim_s)} in the background and a switch of "
                     f"{_terms_text(c.switch_terms)}")
        print(f"  {c.strategy}: {line}")
    chosen = decision.chosen
    print(f"decision: {decision.strategy}: {decision.reason}")
    print(f"transition: {_terms_text(chosen.terms)}")
    print(f"search: {human_seconds(decision.search_s)} (templates: "
          f"{human_seconds(planner.setup_s)}, once per job)")


def _candidate_rows(decision: Decision, base_samples_s: float) -> list[list[str]]:
    """One table row per candidate, the chosen one marked."""
    rows = []
    for c in decision.candidates:
        mark = "*" if c.strategy == decision.strategy and c.feasible else " "
        rows.append([
            f"{mark} {c.strategy}",
            "yes" if c.feasible else "no",
            human_seconds(c.step_s) if math.isfinite(c.step_s) else "-",
            _fmt(c.throughput_samples_s, ".4g") if c.feasible else "-",
            (f"{c.throughput_samples_s / base_samples_s:.1%}"
             if c.feasible else "-"),
            human_seconds(c.transition_s) if math.isfinite(c.transition_s) else "-",
            _fmt(c.score, ".4g"),
            human_bytes(c.peak_memory_bytes) if c.peak_memory_bytes else "-",
            c.reason,
        ])
    return rows
