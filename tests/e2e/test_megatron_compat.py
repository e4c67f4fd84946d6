"""docs/megatron_compat.md is current and complete: every flag of Megatron-LM's GPT command lines
is supported, accepted without effect (with the reason, said at start-up) or refused (with the
reason); the flags accepted without effect really change nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_h2.config.megatron_flags import COMPAT_FLAGS, UNSUPPORTED_FLAGS
from megatron_h2.errors import ConfigError
from megatron_h2.training.arguments import config_from_args, describe_no_effect
from tests.helpers.paths import ROOT

TOOL = ROOT / "tools" / "megatron_compat.py"


@pytest.fixture(scope="module")
def tool():
    from megatron_h2.commands import megatron_compat

    return megatron_compat


@pytest.fixture(scope="module")
def statuses(tool):
    classifier = tool.Classifier()
    return {flag: classifier.status(flag) for flag in tool.read_flag_list()}


def test_doc_is_current(tool):
    text = tool.render()
    assert tool.DOC.exists() and tool.DOC.read_text() == text, (
        f"docs/megatron_compat.md is out of date: run {tool.REGENERATE}")


def test_every_listed_flag_is_classified(tool, statuses):
    unknown = sorted(f for f, (status, _) in statuses.items()
                     if status == tool.UNKNOWN)
    assert not unknown, (f"Megatron flags neither supported, accepted without effect nor refused: "
                         f"{unknown}; declare them (megatron_h2/config/ or "
                         f"megatron_h2/config/megatron_flags.py), then run {tool.REGENERATE}")
    assert all(why for status, why in statuses.values() if status != tool.UNKNOWN)


def test_flag_list_is_megatrons_command_lines(tool):
    flags = tool.read_flag_list()
    assert len(flags) > 250 and all(f.startswith("--") and where for f, where in flags.items())
    assert flags["--use-mcore-models"].startswith("examples")


def test_classes_do_not_overlap(tool):
    actions = tool.Classifier().actions
    supported = {f for f in actions if f not in COMPAT_FLAGS and f.startswith("--")}
    assert not supported & set(UNSUPPORTED_FLAGS)
    assert all(f in actions for f in COMPAT_FLAGS)  # each is accepted by the parser


def test_status_of_each_kind(tool):
    c = tool.Classifier()
    assert c.status("--swiglu")[0] == tool.SUPPORTED
    assert c.status("--num-virtual-stages-per-pipeline-rank")[0] == tool.SUPPORTED
    assert c.status("--manual-gc") == (tool.NO_EFFECT, COMPAT_FLAGS["--manual-gc"].reason)
    assert c.status("--moe-router-topk")[0] == tool.SUPPORTED
    assert c.status("--moe-use-upcycling")[0] == tool.ERROR
    assert c.status("--nproc_per_node")[0] == tool.TORCHRUN
    assert c.status("--no-such-flag") == (tool.UNKNOWN, "")


def _value(entry) -> list[str]:
    if not entry.takes_value:
        return []
    return [entry.choices[-1] if entry.choices else "1"]


BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


NEEDS_ROPE = ("--no-position-embedding",)  # Megatron refuses it without rotary embeddings


def test_no_position_embedding_needs_rope():
    with pytest.raises(ConfigError, match="--no-position-embedding is deprecated"):
        config_from_args([*BASE, "--no-position-embedding"])


@pytest.mark.parametrize("flag", sorted(COMPAT_FLAGS))
def test_no_effect_flag_changes_nothing_and_is_reported(flag):
    """Given with a value Megatron accepts, the run config is the one without the flag, and the
    start-up line names the flag with its reason."""
    entry = COMPAT_FLAGS[flag]
    base = BASE + (["--position-embedding-type", "rope"] if flag in NEEDS_ROPE else [])
    plain, _ = config_from_args(base)
    cfg, launch = config_from_args([*base, flag, *_value(entry)])
    assert cfg == plain
    assert f"{flag} ({entry.reason})" in describe_no_effect(launch)


def test_no_effect_flag_values_are_checked_as_in_megatron():
    with pytest.raises(ConfigError, match="--empty-unused-memory-level"):
        config_from_args([*BASE, "--empty-unused-memory-level", "3"])
    with pytest.raises(ConfigError, match="--ckpt-format"):
        config_from_args([*BASE, "--ckpt-format"])  # takes a value
    _, launch = config_from_args([*BASE, "--cuda-graph-modules", "attn", "mlp"])  # nargs="+"
    assert launch.no_effect == ("--cuda-graph-modules",)


def test_renamed_flag_sets_the_same_field():
    a, _ = config_from_args([*BASE, "--pipeline-model-parallel-size", "2",
                             "--num-virtual-stages-per-pipeline-rank", "2"])
    b, _ = config_from_args([*BASE, "--pipeline-model-parallel-size", "2",
                             "--virtual-pipeline-model-parallel-size", "2"])
    assert a == b and a.parallel.virtual_pipeline_model_parallel_size == 2


def test_check_command_says_how_to_regenerate(tmp_path, tool, capsys):
    proc = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    stale = tmp_path / "megatron_compat.md"
    stale.write_text("old\n")
    tool.DOC, real = stale, tool.DOC
    try:
        assert tool.main(["--check"]) == 1
        assert tool.REGENERATE in capsys.readouterr().err
    finally:
        tool.DOC = real
