"""Transports under the bridge: gloo (default) and NIXL (optional), through the same Bridge
(staging, chunking, bf16 on the wire), and the plan's per-chip-pair selection."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_h2.distributed import transport as transport_module
from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from megatron_h2.distributed.transport import GlooTransport, check_transport, make_transport
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from tests.helpers.dist_utils import run_distributed, tiny_model_flags

HAS_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed "
                                "(pip install 'megatron_h2[nixl]')")


def _plan(transports: list | None) -> dict:
    plan = {"data_parallel_size": 1, "micro_batch_size": 1, "global_batch_size": 2,
            "chips": {"a": {"device": "cpu"}, "b": {"device": "cpu"}},
            "stages": [{"chip": "a", "tensor_parallel_size": 1, "num_layers": 1},
                       {"chip": "b", "tensor_parallel_size": 1, "num_layers": 1}]}
    if transports is not None:
        plan["transports"] = transports
    return plan


def test_plan_selects_a_transport_per_chip_pair(tmp_path):
    plan = HeteroPlan.from_dict(_plan([{"chips": ["b", "a"], "transport": "nixl"}]))
    assert plan.transport_between("a", "b") == plan.transport_between("b", "a") == "nixl"
    assert plan.transport_between("a", "a") == "gloo"
    assert HeteroPlan.from_dict(_plan(None)).transport_between("a", "b") == "gloo"
    plan.to_yaml(tmp_path / "plan.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "plan.yaml") == plan


@pytest.mark.parametrize("links, fragment", [
    ([{"chips": ["a", "c"], "transport": "nixl"}], "unknown chip 'c'"),
    ([{"chips": ["a", "b"], "transport": "nixel"}], "did you mean 'nixl'"),
    ([{"chips": ["a", "b"], "transport": "mooncake"}], "mooncake was evaluated but is not"),
    ([{"chips": ["a"], "transport": "nixl"}], "needs chips: [chip_a, chip_b]"),
    ([{"chips": ["a", "b"]}], "missing key 'transport'"),
    ([{"chips": ["a", "b"], "transport": "gloo"}, {"chips": ["b", "a"], "transport": "nixl"}],
     "twice"),
    ({"a": "b"}, "must be a list"),
])
def test_bad_transports_are_one_line_errors(links, fragment):
    with pytest.raises(ConfigError) as info:
        HeteroPlan.from_dict(_plan(links))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_missing_library_is_reported_before_anything_starts(monkeypatch):
    check_transport("gloo")
    with pytest.raises(ConfigError, match="unknown transport 'rdma'"):
        check_transport("rdma")
    monkeypatch.setitem(transport_module.TRANSPORT_PACKAGES, "nixl", "no_such_nixl_package")
    with pytest.raises(ConfigError, match=r"needs the 'no_such_nixl_package' package.*"
                                          r"pip install 'megatron_h2\[nixl\]'"):
        check_transport("nixl")
    assert isinstance(make_transport("gloo", None, 0, [1], 64, "b0", 1.0), GlooTransport)


SHAPES = [(3, 5, 7), (2, 64, 16), (1,)]


def _transfer_worker(rank: int, world: int, name: str) -> list:
    """Both ranks send each other several tensors at once (more pieces than the ring holds),
    in fp32 and with the bf16 wire, with tiny chunks and through the staged path; returns,
    per case, whether what arrived is exact and how many chunks went."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    peer = 1 - rank
    results = []
    for chunk_mb, staged in ((1e-4, False), (2e-3, True)):
        for wire in (None, torch.bfloat16):
            slot = BridgeConfig(chunk_mb=chunk_mb).chunk_elements(1)
            transport = make_transport(name, group, rank, [peer], slot, "t", 60)
            bridge = Bridge(group, torch.device("cpu"),
                            BridgeConfig(dtype=wire, chunk_mb=chunk_mb), staged=staged,
                            transport=transport)
            exact = []
            for repeat in range(3):
                tensors = [torch.randn(*s, generator=torch.Generator().manual_seed(
                    100 * repeat + 10 * i + rank)) for i, s in enumerate(SHAPES)]
                sends, recvs = bridge.post([(t, peer) for t in tensors],
                                           [(s, torch.float32, peer) for s in SHAPES])
                got = [h.wait() for h in recvs]
                for h in sends:
                    h.wait()
                for i, (s, g) in enumerate(zip(SHAPES, got)):
                    want = torch.randn(*s, generator=torch.Generator().manual_seed(
                        100 * repeat + 10 * i + peer))
                    exact.append(torch.equal(g, want if wire is None
                                             else want.to(wire).float()))
            results.append((chunk_mb, staged, str(wire), all(exact), bridge.stats.chunks))
            bridge.close()
    return results


@pytest.mark.e2e
@needs_nixl
def test_bridge_over_nixl_delivers_exactly():
    for cases in run_distributed(_transfer_worker, 2, "nixl", timeout=120):
        assert len(cases) == 4
        for chunk_mb, staged, wire, exact, chunks in cases:
            assert exact, (chunk_mb, staged, wire)
            assert chunks > 3 * len(SHAPES)  # tensors were cut into several chunks


MODEL = tiny_model_flags()


@pytest.mark.e2e
@needs_nixl
def test_hetero_run_over_nixl_equals_one_process(corpus, tiny_reference, tmp_path):
    """Stage 0 at TP 2, stage 1 at TP 1: the boundary has three ranks and two peers per
    transport; tiny chunks so every activation is many NIXL writes through the ring. The
    precision check of the last iteration runs too (it must not change the losses)."""
    import yaml

    from tests.helpers.dist_utils import losses, torchrun

    log = tmp_path / "log.jsonl"
    plan = _plan([{"chips": ["a", "b"], "transport": "nixl"}])
    plan.update(micro_batch_size=2, global_batch_size=8)
    plan["stages"] = [{"chip": "a", "tensor_parallel_size": 2, "num_layers": 3},
                      {"chip": "b", "tensor_parallel_size": 1, "num_layers": 1}]
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    proc = torchrun(3, [*MODEL, "--data-path", corpus, "--hetero-plan",
                        str(tmp_path / "plan.yaml"), "--force-bridge", "--bridge-chunk-mb",
                        "0.01", "--log-jsonl", str(log), "--precision-check-interval", "10"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "boundary 0-1: bridge over nixl" in proc.stdout
    # the periodic check of a TP-2 stage: its all-reduces run, every other operator is replayed
    assert "stage 0 (chip a, cpu): 0 of " in proc.stdout
    assert "stage 1 (chip b, cpu): 0 of " in proc.stdout
    got, want = losses(log), tiny_reference
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for it, value in want.items():
        assert abs(got[it] - value) <= 1e-5 * abs(value), (it, got[it], value)


def test_start_up_names_each_bridged_boundary_and_unused_entries():
    from megatron_h2.config import ParallelConfig
    from megatron_h2.training.main import say_bridges

    plan = HeteroPlan.from_dict(_plan([{"chips": ["b", "a"], "transport": "nixl"}]))
    lines: list[str] = []
    say_bridges(plan, ParallelConfig(), lines.append)  # both chips are cpu: no bridge
    assert len(lines) == 1 and lines[0].startswith("note: transports entry b/a (nixl) has no "
                                                   "effect")
    lines.clear()
    say_bridges(plan, ParallelConfig(force_bridge=True, bridge_dtype="bf16"), lines.append)
    assert lines == ["boundary 0-1: bridge over nixl (chunks of 4 MiB, bf16 on the wire)"]
