"""tools/profile_chip.py writes a profile table the planner reads."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import profile_chip  # noqa: E402

from megatron_h2.planner.profile import ProfileTable  # noqa: E402


def test_profile_table_round_trip(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    assert profile_chip.main(["--chip", "fast", "--chip", "slow", "--num-layers", "1",
                              "--hidden-size", "64", "--num-attention-heads", "4",
                              "--group-query-attention", "--num-query-groups", "2",
                              "--ffn-hidden-size", "128", "--seq-length", "32", "--vocab-size",
                              "256", "--micro-batch-sizes", "1,2", "--reps", "2", "--warmup", "1",
                              "--output", str(out)]) == 0
    table = ProfileTable.from_yaml(out)
    for chip in ("fast", "slow"):
        prof = table.for_chip(chip)
        assert sorted(prof.micro_batch_sizes) == [1, 2]
        times = prof.micro_batch_sizes[2]
        assert times.layer_forward_ms > 0 and times.head_forward_ms > 0
    assert "micro-batch 2: layer forward" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    assert profile_chip.main(["--chip", "x", "--hidden-size", "64", "--num-attention-heads", "3",
                              "--vocab-size", "256", "--output", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
