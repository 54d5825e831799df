"""``chameleon trace import``: a public fault trace read into our trace's CSV.

::

    chameleon trace import --format node-json --input fault_trace.json --out trace.csv
    chameleon trace import --format straggler-csv --input ops.csv --out trace.csv

``node-json``: node-level fault start/end events with causes (the InfiniteHBD trace's
format); ``straggler-csv``: per-operation timings with stragglers (ByteDance's straggler
traces' columns). How causes map to events: docs/design.md section 6. The written trace
replays with ``chameleon simulate --job JOB.toml --trace trace.csv``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from chameleon_ft.failures import trace_to_csv
from chameleon_ft.failures.importers import import_node_json
from chameleon_ft.failures.stragglers import import_straggler_csv
from chameleon_ft.sim.report import write_files

FORMATS = ("node-json", "straggler-csv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chameleon trace``."""
    parser.add_argument("action", choices=("import",), help="what to do: import")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="node-json: node fault start/end events with causes; "
                             "straggler-csv: per-operation timings with stragglers")
    parser.add_argument("--input", required=True, metavar="FILE", help="the public trace")
    parser.add_argument("--out", required=True, metavar="FILE.csv", help="our trace's CSV")
    parser.add_argument("--workers-per-node", type=int, default=1, metavar="W",
                        help="workers per node of the job that replays it (default 1)")
    parser.add_argument("--num-nodes", type=int, metavar="N",
                        help="nodes of its cluster (default: the trace's)")
    parser.add_argument("--days", type=float, metavar="D",
                        help="node-json: the trace's end (default: its last day, rounded up)")
    parser.add_argument("--degraded-factor", type=float, metavar="F",
                        help="node-json: read degradations (a hot GPU, a link at low speed) "
                             "as fail-slows of factor F instead of node failures")
    parser.add_argument("--threshold", type=float, default=1.1, metavar="X",
                        help="straggler-csv: compute over the stage's median that is slow "
                             "(default 1.1)")
    parser.add_argument("--min-steps", type=int, default=3, metavar="K",
                        help="straggler-csv: steps in a row that start or end a slowdown "
                             "(default 3)")


def run(args: argparse.Namespace) -> int:
    """Run ``chameleon trace import``.

    Raises:
        ValueError: for bad flags or a malformed trace (one line naming the field).
    """
    if args.workers_per_node < 1:
        raise ValueError(f"--workers-per-node: must be >= 1, got {args.workers_per_node}")
    if args.num_nodes is not None and args.num_nodes < 1:
        raise ValueError(f"--num-nodes: must be >= 1, got {args.num_nodes}")
    if args.days is not None and not (math.isfinite(args.days) and args.days > 0):
        raise ValueError(f"--days: must be a positive number, got {args.days}")
    try:
        text = Path(args.input).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--input: cannot read {args.input!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--input: {args.input!r} is not UTF-8 text (byte {exc.start}); "
                         f"a {args.format} trace is") from None
    if args.format == "node-json":
        trace, summary = import_node_json(
            text, workers_per_node=args.workers_per_node, num_nodes=args.num_nodes,
            duration_s=None if args.days is None else args.days * 86400.0,
            degraded_factor=args.degraded_factor)
    else:
        trace, summary = import_straggler_csv(
            text, workers_per_node=args.workers_per_node, num_nodes=args.num_nodes,
            threshold=args.threshold, min_steps=args.min_steps)
    out = Path(args.out)
    write_files(out.parent, {out.name: trace_to_csv(trace).encode()})
    print(f"{args.format}: {summary.line()}; wrote {out} ({trace.duration_s / 86400:.4g} days)",
          file=sys.stderr)
    return 0
