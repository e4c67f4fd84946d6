#!/usr/bin/env python3
"""Draw a measured training timeline (--timeline-trace) as a PNG.

The `megatron-h2-show-timeline` command (code: megatron_h2/commands/show_timeline.py).
"""

import sys

from megatron_h2.commands.show_timeline import main

if __name__ == "__main__":
    sys.exit(main())
