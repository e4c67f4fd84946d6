#!/usr/bin/env python3
"""Plan a model on a heterogeneous cluster (HeteroAuto); see docs/planner.md and --help.

Thin wrapper over megatron_h2.planner.cli so that it runs from a checkout without installing.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_h2.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
