"""megatron_h2 -> torch_dist -> Megatron-Core's own ``dist_checkpointing.load`` (default
strictness, model and optimizer) -> the logits Megatron-Core computed for the fixture, at TP 1
and TP 2 (and PP 2). Optional: runs only where an interpreter with megatron-core is at hand
(``$MEGATRON_CORE_PYTHON``, or this one if it has megatron-core); megatron-core is never a
dependency of megatron_h2."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.convert_cli import convert
from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"


def megatron_core_python() -> str | None:
    if os.environ.get("MEGATRON_CORE_PYTHON"):
        return os.environ["MEGATRON_CORE_PYTHON"]
    try:
        return sys.executable if importlib.util.find_spec("megatron.core") else None
    except ModuleNotFoundError:
        return None


PYTHON = megatron_core_python()


@pytest.mark.skipif(PYTHON is None, reason="megatron-core is not installed "
                    "(set MEGATRON_CORE_PYTHON to an interpreter that has it)")
@pytest.mark.parametrize("name, tp, pp", [("gpt_tp1_pp1", 1, 1), ("gpt_tp1_pp1", 2, 1),
                                          ("llama_tp2_pp1", 1, 1), ("llama_tp2_pp1", 2, 1),
                                          ("gpt_tp2_pp1", 1, 2)])
def test_megatron_core_loads_what_we_write(name, tp, pp, tmp_path):
    assert convert("--from", "megatron", "--to", "megatron_h2", "--input",
                   FIXTURES / name / "torch_dist", "--output", tmp_path / "ours") == 0
    assert convert("--from", "megatron_h2", "--to", "megatron", "--input", tmp_path / "ours",
                   "--output", tmp_path / "megatron", "--target-tensor-parallel-size", tp,
                   "--target-pipeline-parallel-size", pp,
                   "--make-vocab-size-divisible-by", 64 // tp) == 0
    proc = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(tp * pp), str(FIXTURES / "mcore_load.py"), name, str(tp), str(pp),
         str(tmp_path / "megatron" / "iter_0000002")],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    found = re.search(r"MAX_LOGIT_DIFF (\S+)", proc.stdout)
    assert proc.returncode == 0 and found, proc.stderr[-3000:]
    assert float(found.group(1)) <= 1e-6


@pytest.mark.skipif(PYTHON is None, reason="megatron-core is not installed "
                    "(set MEGATRON_CORE_PYTHON to an interpreter that has it)")
@pytest.mark.parametrize("name, ep", [("moe_ep2", 1), ("moe_ep1", 2), ("moe_freq", 2)])
def test_megatron_core_loads_our_moe_at_any_expert_parallel_size(name, ep, tmp_path):
    """What we write holds every expert at its global index: Megatron-Core loads it at EP 1 and
    EP 2, whichever EP the fixture was saved at (with a dense layer among the MoE ones too)."""
    assert convert("--from", "megatron", "--to", "megatron_h2", "--input",
                   FIXTURES / name / "torch", "--output", tmp_path / "ours") == 0
    assert convert("--from", "megatron_h2", "--to", "megatron", "--input", tmp_path / "ours",
                   "--output", tmp_path / "megatron", "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1, "--make-vocab-size-divisible-by",
                   64) == 0
    proc = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ep),
         str(FIXTURES / "mcore_load.py"), name, "1", "1",
         str(tmp_path / "megatron" / "iter_0000002"), str(ep)],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    found = re.search(r"MAX_LOGIT_DIFF (\S+)", proc.stdout)
    assert proc.returncode == 0 and found, proc.stderr[-3000:]
    assert float(found.group(1)) <= 1e-6
