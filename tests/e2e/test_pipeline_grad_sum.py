"""The gradient sum across data-parallel pipelines, in real processes (gloo): three pipelines
that shard the same parameters differently (TP 1 with DP 2, TP 2, two stages) each hold a known
gradient; after the exchange every rank holds, in every range it answers for, the total in
pipeline order, bitwise, under the replicated optimizer and ZeRO-1, directly and through the
bridge."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_h2.distributed.bridge import BridgeConfig
from megatron_h2.distributed.grad_sync import GradBuckets
from megatron_h2.distributed.pipeline_sum import PipelineGradSum
from megatron_h2.distributed.shard_boxes import ParamLayout
from megatron_h2.distributed.topology import build_topology
from megatron_h2.parallel.sharding import TPShard, shard_tensor
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from tests.helpers.dist_utils import run_distributed

# name -> (full shape, TP split (dim, blocks) or None, layer); layer 0 on the first stage
PARAMS = {
    "col.weight": ((8, 6), (0, 1), 0),
    "fused.weight": ((8, 3), (0, 2), 0),
    "emb.weight": ((6, 4), (0, 1), 0),
    "row.weight": ((4, 8), (1, 1), 1),
    "bias": ((8,), (0, 1), 1),
    "norm.weight": ((5,), None, 1),
}
CASES = [(False, False), (True, False), (False, True), (True, True)]  # (ZeRO-1, bridge)


def plan() -> HeteroPlan:
    chips = {"a": ChipSpec("cpu"), "b": ChipSpec("cpu")}

    def one(stages, dp=1):
        return HeteroPlan(dp, 1, 4, chips, stages)

    return HeteroPlan.of_pipelines([
        one([StageSpec("a", 1, 2)], dp=2),  # ranks 0, 1
        one([StageSpec("b", 2, 2)]),  # ranks 2, 3
        one([StageSpec("a", 1, 1), StageSpec("b", 1, 1)]),  # ranks 4, 5
    ])


def full_grad(name: str, pipeline: int) -> torch.Tensor:
    shape = PARAMS[name][0]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{pipeline}".encode()))
    return torch.randn(shape, generator=gen)


def local(full: torch.Tensor, split, tp_rank: int, tp_size: int) -> torch.Tensor:
    return full.clone() if split is None else shard_tensor(full, TPShard(*split), tp_rank,
                                                           tp_size)


def _worker(rank: int, world: int) -> list[dict]:
    job = plan()
    topo = build_topology(job, rank, world)
    pp = topo.pp_size
    out = []
    for zero, bridge in CASES:
        params, layouts, names = [], {}, {}
        for name, (shape, split, layer) in PARAMS.items():
            if pp > 1 and layer != topo.stage and name != "emb.weight":
                continue
            copy = name == "emb.weight" and pp > 1 and topo.stage == 1  # the tied copy
            value = local(torch.zeros(shape), split, topo.tp_rank, topo.tp_size)
            param = torch.nn.Parameter(value)
            params.append(param)
            names[param] = name
            primary = not copy and not (split is None and topo.tp_rank != 0)
            layouts[param] = ParamLayout(name, shape, None if split is None else split[0],
                                         1 if split is None else split[1], primary=primary)
        emb = [p for p in params if names[p] == "emb.weight"]
        buckets = GradBuckets(params, topo.dp_group, bucket_size_mb=40 / 2**20, overlap=True,
                              reduce_scatter=zero, deferred=emb if pp > 1 else [])
        late = [p for p in params if names[p] == "norm.weight"]

        def grads(b=buckets, z=zero) -> list[torch.Tensor]:  # what the optimizer reads
            return [x.shard_grad if z else x.buffer for x in b.buckets]

        summer = PipelineGradSum(topo, buckets, layouts, late, grads,
                                 BridgeConfig(force=bridge, chunk_mb=1e-4), torch.device("cpu"))
        buckets.on_synced = summer.bucket_synced
        buckets.start_sync()
        for param in reversed(params):  # this replica's share of its pipeline's gradient
            full = full_grad(names[param], topo.pipeline)
            split = PARAMS[names[param]][1]
            part = local(full, split, topo.tp_rank, topo.tp_size)
            if topo.dp_size > 1:  # two replicas: halves that add up exactly
                part = part / 2
            (param * part).sum().backward()
        # without a DP group every bucket before the deferred one left during the backward
        sent_early = summer.buckets_sent == buckets.first_deferred or topo.dp_size > 1
        buckets.finish_sync()
        summer.finish()
        if zero:
            held = [(b.shard_range(buckets.dp_rank), b.shard_grad.numpy().copy(),
                     [(names[s.param], s.offset, s.numel) for s in b.slots])
                    for b in buckets.buckets]
            out.append({"zero": held, "tp": (topo.tp_rank, topo.tp_size), "early": sent_early})
        else:
            out.append({"grads": {names[p]: p.main_grad.numpy().copy() for p in params},
                        "tp": (topo.tp_rank, topo.tp_size), "early": sent_early})
        summer.close()
    return out  # numpy arrays: pickled by value


def total(name: str) -> torch.Tensor:
    value = full_grad(name, 0).clone()  # replicas' halves add up exactly to the whole
    for pipeline in (1, 2):
        value += full_grad(name, pipeline)
    return value


@pytest.mark.e2e
def test_every_holder_gets_the_total_in_pipeline_order():
    runs = run_distributed(_worker, 6)
    for case, (zero, _) in enumerate(CASES):
        for rank, per_rank in enumerate(runs):
            got = per_rank[case]
            tp_rank, tp_size = got["tp"]
            assert got["early"], (case, rank)
            if not zero:
                for name, grad in got["grads"].items():
                    grad = torch.from_numpy(grad)
                    want = local(total(name), PARAMS[name][1], tp_rank, tp_size)
                    assert torch.equal(grad, want), (case, rank, name)
                continue
            for (lo, hi), shard, slots in got["zero"]:
                shard = torch.from_numpy(shard)
                for name, offset, numel in slots:
                    want = local(total(name), PARAMS[name][1], tp_rank, tp_size).reshape(-1)
                    start, end = max(lo, offset), min(hi, offset + numel)
                    if start < end:
                        assert torch.equal(shard[start - lo:end - lo],
                                           want[start - offset:end - offset]), (case, rank, name)
