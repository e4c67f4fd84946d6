#!/usr/bin/env python3
"""Plan a model on a heterogeneous cluster (HeteroAuto); see docs/planner.md.

The `megatron-h2-plan` command (code: megatron_h2/planner/cli.py).
"""

import sys

from megatron_h2.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
