"""CPU emulation in the cost model: a profile's CPU times and a cluster's ``host_cores``
(megatron_h2.planner.cost_model, profile, cluster, pipelines_cost, simulator)."""

import copy
import json

import pytest
import yaml

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.calibration import LinkTimes, calibrated_cluster
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.pipelines_cost import evaluate_plan, simulate_plan
from megatron_h2.planner.profile import ProfileTable
from megatron_h2.planner.simulator import simulate

CHIP = {"device": "cpu", "count": 4, "chips_per_node": 1, "tflops_bf16": 1, "memory_gib": 8,
        "intra_node_gb_per_s": 1000, "inter_node_gb_per_s": 1000}
CLUSTER = {"chips": {"fast": dict(CHIP), "slow": dict(CHIP, emulate_slowdown=3.0)},
           "cross_chip_gb_per_s": 1000}
CHIPS = {"fast": ChipSpec("cpu"), "slow": ChipSpec("cpu", 3.0)}
SHAPE = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
         "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}
MODEL = model_from_dict(SHAPE)
TIMES = {1: {"layer_forward_ms": 10.0, "layer_backward_ms": 20.0, "embedding_forward_ms": 1.0,
             "embedding_backward_ms": 1.0, "head_forward_ms": 4.0, "head_backward_ms": 8.0}}


def profile(fraction: float | None, optimizer_ns: float = 0.0) -> ProfileTable:
    """Measured at the wall times of TIMES, ``fraction`` of them CPU time (None: not given)."""
    entry: dict = {"micro_batch_sizes": copy.deepcopy(TIMES),
                   "optimizer_ns_per_param": optimizer_ns}
    if fraction is not None:
        entry["cpu_micro_batch_sizes"] = {
            size: {k: v * fraction for k, v in row.items()} for size, row in TIMES.items()}
        entry["optimizer_cpu_ns_per_param"] = optimizer_ns * fraction
    return ProfileTable.from_dict({"chips": {"fast": entry, "slow": copy.deepcopy(entry)}})


def cost(fraction: float | None, host_cores: float | None = None,
         optimizer_ns: float = 0.0) -> CostModel:
    data = dict(CLUSTER, host_cores=host_cores) if host_cores else CLUSTER
    return CostModel(Cluster.from_dict(data), MODEL, CostConfig(),
                     profile(fraction, optimizer_ns))


def plan(*stages: tuple[str, int, int], global_batch: int = 8) -> HeteroPlan:
    """A 1F1B plan of (chip, layers, DP) stages, micro-batch 1."""
    return HeteroPlan(1, 1, global_batch, CHIPS,
                      [StageSpec(c, 1, n, data_parallel_size=d) for c, n, d in stages])


def test_profile_reads_and_checks_cpu_times():
    assert profile(None).for_chip("fast").times(1, cpu=True).layer_forward_ms == 10.0
    chip = profile(0.25, 4.0).for_chip("slow")
    assert chip.times(1, cpu=True).head_backward_ms == 2.0
    assert chip.times(2, cpu=True).layer_forward_ms == 5.0  # scaled as the wall times are
    assert chip.times(1).layer_forward_ms == 10.0 and chip.optimizer_cpu_ns_per_param == 1.0
    entry = {"micro_batch_sizes": TIMES, "cpu_micro_batch_sizes": {2: TIMES[1]}}
    with pytest.raises(ConfigError, match="cpu_micro_batch_sizes"):
        ProfileTable.from_dict({"chips": {"fast": entry}})
    entry = {"micro_batch_sizes": TIMES, "optimizer_cpu_ns_per_param": -1}
    with pytest.raises(ConfigError, match="optimizer_cpu_ns_per_param"):
        ProfileTable.from_dict({"chips": {"fast": entry}})


def test_cluster_reads_writes_and_checks_host_cores():
    cluster = Cluster.from_dict(dict(CLUSTER, host_cores=1.8))
    assert cluster.host_cores == 1.8
    again = Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict())))
    assert again.host_cores == 1.8 and again.subset(["slow"]).host_cores == 1.8
    from megatron_h2.elastic.replan import with_counts

    assert with_counts(cluster, {"fast": 1}).host_cores == 1.8  # re-planning on fewer chips
    assert Cluster.from_dict(CLUSTER).host_cores is None
    with pytest.raises(ConfigError, match="host_cores"):
        Cluster.from_dict(dict(CLUSTER, host_cores=0))
    links = LinkTimes(0.01, 1 << 20, 0.001, 1 << 16)
    assert calibrated_cluster(CLUSTER, links, host_cores=1.5)["host_cores"] == 1.5
    assert "host_cores" not in calibrated_cluster(CLUSTER, links)


def test_a_slowed_pass_is_padded_by_its_cpu_time():
    """The runtime sleeps (s - 1) x CPU time: a pass measured at t with CPU time f t takes
    t (1 + (s - 1) f) on a chip s times slower, t itself at s = 1."""
    for fraction in (1.0, 0.4):
        layer = cost(fraction).stage_costs("slow", 1, 1, 1).layer_forward
        assert layer == pytest.approx(0.010 * (1 + 2.0 * fraction))
        assert cost(fraction).stage_costs("fast", 1, 1, 1).layer_forward == pytest.approx(0.010)
    # as a chip of its own under host_cores: its CPU time, padded
    assert cost(0.4, 2.0).stage_costs("slow", 1, 1, 1).layer_forward == pytest.approx(
        0.010 * 0.4 * 3.0)


def test_host_cores_bound_the_step_by_the_cpu_work():
    """Many processes on few cores: the step is the CPU work of every rank over the cores; few
    processes: the pipeline's own step, as without host_cores."""
    many = plan(("slow", 1, 2), ("fast", 1, 1), ("fast", 1, 1), ("fast", 1, 1))
    model = cost(0.5, host_cores=1.0, optimizer_ns=3.0)
    est = model.evaluate(many)
    per_rank = [(s.forward_s + s.backward_s) for s in est.stages]
    slow = 3.0
    expected = (8 * per_rank[0] / slow + sum(8 * w for w in per_rank[1:])
                + 2 * est.stages[0].optimizer_s + sum(s.optimizer_s for s in est.stages[1:]))
    assert est.host_cpu_s == pytest.approx(expected)
    assert est.stages[1].optimizer_s > 0
    assert est.step_time_s == pytest.approx(expected / 1.0)
    assert est.step_time_s > cost(0.5, host_cores=100.0, optimizer_ns=3.0).evaluate(
        many).step_time_s
    assert simulate(many, model).step_time_s == pytest.approx(est.step_time_s)
    # enough cores: the bound does not bind and the pipeline's terms give the step
    roomy = cost(0.5, host_cores=100.0).evaluate(many)
    assert roomy.step_time_s == pytest.approx(roomy.pipeline_s + roomy.link_s + roomy.dp_sync_s)
    assert cost(0.5).evaluate(many).host_cpu_s == 0.0  # not emulated: no bound


def test_pipelines_share_the_host():
    """Two pipelines on one host: their CPU work adds up before it is divided by the cores."""
    two = HeteroPlan.of_pipelines([plan(("fast", 4, 1), global_batch=4),
                                   plan(("slow", 4, 1), global_batch=4)])
    model = cost(0.5, host_cores=0.5)
    est = evaluate_plan(model, two)
    work = sum(e.host_cpu_s for e in est.pipelines)
    assert work > 0 and est.step_time_s == pytest.approx(work / 0.5)
    assert simulate_plan(model, two).step_time_s == pytest.approx(est.step_time_s)


def test_step_time_command_says_what_the_cpu_work_bound_gives(tmp_path, capsys):
    from megatron_h2.commands.step_time import main

    many = plan(("slow", 1, 2), ("fast", 1, 1), ("fast", 1, 1), ("fast", 1, 1))
    many.to_yaml(tmp_path / "plan.yaml")
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(dict(CLUSTER, host_cores=1.0)))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(SHAPE))
    entry = {"micro_batch_sizes": TIMES, "cpu_micro_batch_sizes": TIMES}
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(
        {"chips": {"fast": entry, "slow": entry}}))
    (tmp_path / "m.jsonl").write_text("".join(
        json.dumps({"iteration": i, "iteration_ms": 500.0}) + "\n" for i in range(1, 5)))
    assert main(["--plan", str(tmp_path / "plan.yaml"), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--model", str(tmp_path / "model.yaml"), "--profile",
                 str(tmp_path / "profile.yaml"), "--metrics", str(tmp_path / "m.jsonl"),
                 "--skip", "1"]) == 0
    est = cost(1.0, host_cores=1.0).evaluate(many)
    out = capsys.readouterr().out
    assert f"predicted step time: {est.step_time_s:.2f} s" in out
    assert f"take {est.host_cpu_s:.2f} s of CPU time per step" in out
    assert f"over the 1.00 cores the processes got when measured (host_cores) that is " \
           f"{est.host_cpu_s:.2f} s" in out
