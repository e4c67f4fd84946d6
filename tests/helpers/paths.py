"""Where the repository is, for tests that run its scripts, tools and examples."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
