"""Draw a measured training timeline (the Chrome / Perfetto trace that
`pretrain_gpt.py --timeline-trace FILE` writes) as a PNG: one row per rank, forward light,
backward dark, zero-bubble's deferred weight gradients (W) hatched, communication waits grey, for
the last few traced iterations. With virtual pipeline stages each model chunk has its own colour
(and its number on the bars that are wide enough); otherwise each stage has one.

    python tools/show_timeline.py runs/demo/timeline.json --output runs/demo/timeline.png
"""

import argparse
import json
import sys
from pathlib import Path

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
STYLES = {"forward": {"alpha": 0.45}, "backward": {"alpha": 1.0},
          "backward_input": {"alpha": 1.0},
          "backward_weight": {"alpha": 0.8, "hatch": "////", "edgecolor": "black"}}


def load(path: Path) -> tuple[list[dict], dict[int, str], dict[int, int]]:
    """Complete events, stage labels (pid -> name) and rank -> stage."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: cannot read trace {path}: {exc}") from None
    events = data.get("traceEvents", [])
    labels = {e["pid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    stage_of = {e["tid"]: e["pid"] for e in spans}
    return spans, labels, stage_of


def draw(spans: list[dict], labels: dict[int, str], stage_of: dict[int, int], output: Path,
         iterations: int) -> None:
    import matplotlib.pyplot as plt

    fig = figure(spans, labels, stage_of, iterations)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def figure(spans: list[dict], labels: dict[int, str], stage_of: dict[int, int],
           iterations: int):
    """The matplotlib figure of the last ``iterations`` traced iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traced = sorted({e["args"].get("iteration", 0) for e in spans})
    keep = set(traced[-iterations:])
    spans = [e for e in spans if e["args"].get("iteration", 0) in keep]
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    ranks = sorted(stage_of)
    chunked = any("chunk" in e["args"] for e in spans)
    split = any(e["cat"] == "backward_weight" for e in spans)
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(ranks) + 1.5))
    for row, rank in enumerate(ranks):
        for e in (x for x in spans if x["tid"] == rank):
            chunk = e["args"].get("chunk", 0)
            color = COLORS[(chunk if chunked else stage_of[rank]) % len(COLORS)]
            x, width = (e["ts"] - start) / 1e6, e["dur"] / 1e6
            style = STYLES.get(e["cat"], {"facecolors": "grey", "alpha": 0.4})
            ax.broken_barh([(x, width)], (row - 0.4, 0.8),
                           **{"facecolors": color, "edgecolor": "white", **style})
            if chunked and e["cat"] in STYLES and width > (end - start) / 1e6 / 150:
                ax.text(x + width / 2, row, str(chunk), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}: {labels.get(stage_of[r], '')}" for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    kinds = "light: forward, dark: backward" + (" (input gradient), hatched: weight gradients"
                                                if split else "")
    ax.set_title(f"measured pipeline timeline, iterations {min(keep)}-{max(keep)} ({kinds}, "
                 "grey: communication)", fontsize=9)
    if chunked:
        chunks = sorted({e["args"]["chunk"] for e in spans if "chunk" in e["args"]})
        ax.legend(handles=[Patch(color=COLORS[c % len(COLORS)], label=f"chunk {c}")
                           for c in chunks], fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--output", help="PNG path (default: the trace's name with .png)")
    p.add_argument("--iterations", type=int, default=2, help="last N traced iterations")
    a = p.parse_args(argv)
    trace = Path(a.trace)
    spans, labels, stage_of = load(trace)
    if not spans:
        print(f"error: {trace} holds no timeline events", file=sys.stderr)
        return 2
    output = Path(a.output) if a.output else trace.with_suffix(".png")
    draw(spans, labels, stage_of, output, max(1, a.iterations))
    print(f"timeline picture: {output}")
    return 0

