"""NIXL (optional) under the bridge across processes: tensors both ways at once through the
same Bridge (staging, chunking, bf16 on the wire), and a heterogeneous run over NIXL with the
losses of one process. Skipped where nixl is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from megatron_h2.distributed.transport import make_transport
from tests.helpers.dist_utils import run_distributed, tiny_model_flags
from tests.unit.distributed.test_transport import _plan

HAS_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed "
                                "(pip install 'megatron_h2[nixl]')")

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

    from tests.helpers.dist_utils import losses
    from tests.helpers.fork_run import fork_run

    log = tmp_path / "log.jsonl"
    plan = _plan([{"chips": ["a", "b"], "transport": "nixl"}])
    plan.update(micro_batch_size=2, global_batch_size=8)
    plan["stages"] = [{"chip": "a", "tensor_parallel_size": 2, "num_layers": 3},
                      {"chip": "b", "tensor_parallel_size": 1, "num_layers": 1}]
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    proc = fork_run(3, [*MODEL, "--data-path", corpus, "--hetero-plan",
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
