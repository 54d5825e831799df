"""Write the synthetic node-level fault trace (the InfiniteHBD trace's published shape).

    PYTHONPATH=src python examples/traces/make_node_faults.py > examples/traces/node-faults-synthetic.json

The public trace itself (github.com/stepfun-ai/InfiniteHBD-Trace, ``fault_trace.json``) is
not in this repository: it is published without a licence that allows redistribution.
``chameleon_ft.failures.synthetic`` says what is the published trace's and what is ours.
"""

from __future__ import annotations

import sys

from chameleon_ft.failures.synthetic import node_faults_json, synthetic_node_faults

if __name__ == "__main__":
    sys.stdout.write(node_faults_json(synthetic_node_faults(int(sys.argv[1]) if len(sys.argv) > 1
                                                            else 0)))
