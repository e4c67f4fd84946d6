"""tools/profile_chip.py writes a profile table the planner reads."""

import pytest

from megatron_h2.commands import profile_chip
from megatron_h2.planner.profile import ProfileTable
from tests.helpers.paths import ROOT


def test_profile_table_round_trip(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    assert profile_chip.main(["--chip", "fast", "--chip", "slow", "--num-layers", "1",
                              "--hidden-size", "64", "--num-attention-heads", "4",
                              "--group-query-attention", "--num-query-groups", "2",
                              "--ffn-hidden-size", "128", "--seq-length", "32", "--vocab-size",
                              "256", "--micro-batch-sizes", "1,2", "--reps", "2", "--warmup", "1",
                              "--max-wait", "0", "--output", str(out)]) == 0
    table = ProfileTable.from_yaml(out)
    for chip in ("fast", "slow"):
        prof = table.for_chip(chip)
        assert sorted(prof.micro_batch_sizes) == [1, 2]
        times = prof.micro_batch_sizes[2]
        assert times.layer_forward_ms > 0 and times.head_forward_ms > 0
        cpu = prof.times(2, cpu=True)  # measured (single-threaded on the CPU)
        assert cpu is not prof.times(2) and 0 < cpu.layer_forward_ms
        assert 0 < prof.optimizer_cpu_ns_per_param
    assert "micro-batch 2: layer forward" in capsys.readouterr().out


def test_repeat_gives_each_passs_cpu_time():
    """A pass that sleeps takes wall time but almost no CPU time."""
    import time

    from megatron_h2.measurement.chip_timing import Pace, repeat

    def asleep() -> float:
        start = time.perf_counter()
        time.sleep(0.02)
        return (time.perf_counter() - start) * 1e3

    cpu: list[list[float]] = [[]]
    (times,) = repeat(Pace(), 1, 3, asleep, cpu_ms=cpu)
    assert len(times) == 3 and len(cpu[0]) == 3
    assert min(times) >= 20 and max(cpu[0]) < 10


def test_bad_input_is_one_line(tmp_path, capsys):
    assert profile_chip.main(["--chip", "x", "--hidden-size", "64", "--num-attention-heads", "3",
                              "--vocab-size", "256", "--output", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


SMALL = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--vocab-size", "256", "--micro-batch-sizes", "1", "--reps", "2",
         "--warmup", "1", "--max-wait", "0"]


def test_measures_optimizer_and_selective_recompute_and_names_the_cluster_chips(tmp_path):
    out = tmp_path / "profile.yaml"
    cluster = ROOT / "examples" / "clusters" / "cpu_2types.yaml"
    assert profile_chip.main([*SMALL, "--cluster", str(cluster), "--output", str(out)]) == 0
    table = ProfileTable.from_yaml(out)
    assert sorted(table.chips) == ["fast", "slow"]
    for chip in table.chips.values():
        assert chip.optimizer_ns_per_param > 0
        assert chip.micro_batch_sizes[1].selective_recompute_ms is not None


def test_cache_reuses_a_measurement_of_the_same_inputs(tmp_path, monkeypatch, capsys):
    from megatron_h2.measurement import chip_timing as library

    monkeypatch.setenv("MEGATRON_H2_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert profile_chip.main([*SMALL, "--chip", "fast", "--cache", "--output", str(first)]) == 0
    assert len(list((tmp_path / "cache" / "profiles").iterdir())) == 1
    capsys.readouterr()

    def measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(library, "profile_model", measuring)
    assert profile_chip.main([*SMALL, "--chip", "fast", "--cache", "--output", str(second)]) == 0
    assert "using the measurement of" in capsys.readouterr().out
    assert second.read_text() == first.read_text()
    with pytest.raises(AssertionError, match="measured again"):  # another shape: measures
        profile_chip.main([*SMALL, "--chip", "fast", "--cache", "--hidden-size", "32",
                           "--output", str(second)])


def test_cache_key_follows_shape_torch_and_machine(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("MEGATRON_H2_CACHE", str(tmp_path))
    args = profile_chip.parse([*SMALL, "--chip", "fast", "--output", "p.yaml"])
    key = profile_chip.cache_file(args, profile_chip.model_config(args), [1])
    assert key.parent == tmp_path / "profiles"
    other = profile_chip.parse([*SMALL, "--chip", "fast", "--output", "p.yaml", "--seq-length",
                                "64"])
    assert profile_chip.cache_file(other, profile_chip.model_config(other), [1]) != key
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert profile_chip.cache_file(args, profile_chip.model_config(args), [1]) != key
    monkeypatch.undo()
    monkeypatch.setenv("MEGATRON_H2_CACHE", str(tmp_path))
    monkeypatch.setattr(profile_chip, "describe_machine", lambda: "another machine")
    assert profile_chip.cache_file(args, profile_chip.model_config(args), [1]) != key


def test_measures_the_runs_dropout_and_the_planner_holds_it_to_it(tmp_path, monkeypatch):
    """Dropout costs time (random masks), so the profile measures the model with the run's
    probabilities, records them, and the planner refuses it for a model with other ones."""
    from megatron_h2.measurement import chip_timing as library
    from megatron_h2.planner.model_input import model_from_dict

    seen = []
    measure = library.profile_model

    def recording(cfg, *args, **kwargs):
        seen.append((cfg.hidden_dropout, cfg.attention_dropout))
        return measure(cfg, *args, **kwargs)

    monkeypatch.setattr(library, "profile_model", recording)
    out = tmp_path / "profile.yaml"
    assert profile_chip.main([*SMALL, "--chip", "fast", "--hidden-dropout", "0",
                              "--attention-dropout", "0.05", "--output", str(out)]) == 0
    assert seen == [(0.0, 0.05)]
    table = ProfileTable.from_yaml(out)
    assert table.model["hidden_dropout"] == 0.0 and table.model["attention_dropout"] == 0.05
    shape = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
             "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 128,
             "seq_length": 32, "vocab_size": 256}
    table.check(model_from_dict({**shape, "hidden_dropout": 0.0, "attention_dropout": 0.05}),
                ["fast"])
    with pytest.raises(ValueError, match="measured for hidden_dropout 0.0 but the model has 0.1"):
        table.check(model_from_dict({**shape, "attention_dropout": 0.05}), ["fast"])
