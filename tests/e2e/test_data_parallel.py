"""Data parallelism across processes: bucketed gradient sync with overlap, and the ZeRO-1
distributed optimizer.

Multi-process runs (gloo, DP=2 and DP=3, two micro-batches per step) are compared with a
single-process reference that trains on the concatenated global batch with plain AdamW. Each DP
size is spawned once per module; the tests read the results.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.distributed import GradBuckets, broadcast_params, grad_sync
from megatron_h2.optimizer import build_data_parallel_optimizer, clip_grad_norm
from megatron_h2.optimizer.adamw import build_optimizer, optimizer_state_to_named
from tests.helpers.dist_utils import run_distributed
from tests.helpers.tolerances import summation_atol
from tests.unit.distributed.test_data_parallel import (
    CONFIG,
    GLOBAL_BATCH,
    LARGE,
    SMALL,
    TINY,
    global_batch,
    loss_sum,
    make_model,
    names_of,
)

MICRO_BATCHES = 2
STEPS = 4
SAVE_AFTER = 2  # the checkpoint is taken after this many steps
LRS = [0.01, 0.02, 0.015, 0.005]
MAX_NORM = 0.5  # low enough that some steps clip

# (optimizer, bucket_size_mb, overlap) per DP size
SCENARIOS = {
    1: [("replicated", SMALL, True), ("zero", TINY, True)],
    2: [("replicated", TINY, True), ("replicated", LARGE, False), ("zero", TINY, True),
        ("zero", SMALL, True), ("zero", LARGE, False)],
    3: [("replicated", SMALL, True), ("zero", TINY, True), ("zero", SMALL, False),
        ("zero", LARGE, True)],
}
CKPT_SCENARIO = ("zero", SMALL, True)  # saved at DP=2
RESUME_SCENARIOS = {1: ("replicated", SMALL, True), 3: ("zero", TINY, True)}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_run() -> dict:
    """Single process, whole global batch, ``build_optimizer``'s AdamW."""
    model = make_model()
    opt = build_optimizer(model, CONFIG)
    params, ckpt = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss_sum(model, *global_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        opt.step()
        params.append(snapshot(model))
        if step + 1 == SAVE_AFTER:
            ckpt = (snapshot(model), optimizer_state_to_named(opt, names_of(model)))
    return {"params": params, "ckpt": ckpt}


def dp_step(model: nn.Module, opt, step: int, rank: int, dp: int) -> torch.Tensor:
    """One training step on this rank's share of the global batch, two micro-batches."""
    x, y = global_batch(step)
    share = GLOBAL_BATCH // dp
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    opt.zero_grad()
    for i, (xm, ym) in enumerate(zip(xs.chunk(MICRO_BATCHES), ys.chunk(MICRO_BATCHES))):
        if i == MICRO_BATCHES - 1:
            opt.grad_buckets.start_sync()
        loss_sum(model, xm, ym).backward()
    opt.grad_buckets.finish_sync()
    norm = clip_grad_norm(opt, MAX_NORM)
    opt.set_lr(LRS[step])
    opt.step()
    return norm


def train(scenario: tuple, group, rank: int, dp: int, start: int = 0, ckpt=None) -> tuple:
    """Params after each step from ``start`` (resuming from ``ckpt`` when given), and for
    :data:`CKPT_SCENARIO` the (params, named state) after :data:`SAVE_AFTER` steps."""
    kind, bucket_mb, overlap = scenario
    model = make_model()
    opt = build_data_parallel_optimizer(model, CONFIG, group, bucket_size_mb=bucket_mb,
                                        overlap=overlap,
                                        use_distributed_optimizer=kind == "zero")
    if ckpt is not None:
        model.load_state_dict(ckpt[0])
        opt.load_named_state(names_of(model), ckpt[1])
    out, saved = [], None
    for step in range(start, STEPS):
        dp_step(model, opt, step, rank, dp)
        out.append(snapshot(model))
        if step + 1 == SAVE_AFTER and scenario == CKPT_SCENARIO:
            saved = (snapshot(model), opt.named_state(names_of(model)))
    return out, saved


# --------------------------------------------------------------------- multi-process workers
def _record_launches(events: list) -> dict:
    """Wrap the collectives GradBuckets launches so each launch is logged in ``events``."""
    originals = {"all_reduce": dist.all_reduce,
                 "reduce_scatter": grad_sync._reduce_scatter_flat}

    def all_reduce(tensor, *args, **kwargs):
        events.append("launch")
        return originals["all_reduce"](tensor, *args, **kwargs)

    def reduce_scatter(out, inp, *args, **kwargs):
        events.append("launch")
        return originals["reduce_scatter"](out, inp, *args, **kwargs)

    dist.all_reduce, grad_sync._reduce_scatter_flat = all_reduce, reduce_scatter
    return originals


def overlap_probe(rank: int, dp: int, reduce_scatter: bool, overlap: bool = True) -> list:
    """Event order during a two-micro-batch step with tiny buckets; ``overlap``: what
    ``--overlap-grad-reduce`` (off by default, as in Megatron) passes to the buckets."""
    model = make_model()
    buckets = GradBuckets(list(model.parameters()), dist.group.WORLD, TINY, overlap=overlap,
                          reduce_scatter=reduce_scatter)
    events: list = []
    for name, p in model.named_parameters():  # registered after GradBuckets': run after them
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(f"grad {name}"))
    originals = _record_launches(events)
    try:
        x, y = global_batch(0)
        for i, (xm, ym) in enumerate(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))):
            if i == MICRO_BATCHES - 1:
                buckets.start_sync()
            loss_sum(model, xm, ym).backward()
            events.append("backward done")
        buckets.finish_sync()
        events.append(f"buckets {len(buckets.buckets)}")
    finally:
        dist.all_reduce, grad_sync._reduce_scatter_flat = originals.values()
    return events


def param_overlap_run(rank: int, dp: int, overlap: bool) -> dict:
    """ZeRO with tiny buckets, with or without --overlap-param-gather: each step's loss (the
    forward reads the parameters the previous step's all-gather delivered) and the final
    parameters."""
    model = make_model()
    opt = build_data_parallel_optimizer(model, CONFIG, dist.group.WORLD, bucket_size_mb=TINY,
                                        overlap=True, use_distributed_optimizer=True,
                                        overlap_param_gather=overlap)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        share = GLOBAL_BATCH // dp
        opt.zero_grad()
        opt.grad_buckets.start_sync()
        loss = loss_sum(model, x[rank * share:(rank + 1) * share],
                        y[rank * share:(rank + 1) * share])
        loss.backward()
        losses.append(loss.detach().clone())
        opt.grad_buckets.finish_sync()
        clip_grad_norm(opt, MAX_NORM)
        opt.set_lr(LRS[step])
        opt.step()
    opt.finish_param_sync()
    return {"losses": losses, "params": snapshot(model)}


def param_gather_probe(rank: int, dp: int) -> dict:
    """Event order of one step and the next forward under --overlap-param-gather."""
    from megatron_h2.optimizer import distributed_optimizer as dopt

    model = make_model()
    opt = build_data_parallel_optimizer(model, CONFIG, dist.group.WORLD, bucket_size_mb=TINY,
                                        overlap=True, use_distributed_optimizer=True,
                                        overlap_param_gather=True)
    events: list = []
    real_gather = dopt.all_gather_flat
    bucket_of_master = {id(m): i for i, m in enumerate(opt._masters)}

    class Logged:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append(f"wait {self.index}")
            return self.work.wait()

    def gather(out, shard, group, async_op=False):
        index = bucket_of_master[id(shard)]
        events.append(f"launch {index}")
        return Logged(real_gather(out, shard, group, async_op=async_op), index)

    dopt.all_gather_flat = gather
    try:
        for i, module in enumerate(model):  # pre-hooks after the optimizer's: run after them
            module.register_forward_pre_hook(lambda *_, i=i: events.append(f"forward {i}"))
        x, y = global_batch(0)
        opt.zero_grad()
        loss_sum(model, x, y).backward()
        opt.grad_buckets.finish_sync()
        last = model[5].weight.detach().clone()
        events.clear()
        opt.step()
        events.append("step done")
        stale = torch.equal(model[5].weight, last)  # not yet gathered
        model(x)
        updated = not torch.equal(model[5].weight, last)
    finally:
        dopt.all_gather_flat = real_gather
    buckets = [[id(slot.param) for slot in b.slots] for b in opt.grad_buckets.buckets]
    where = {i: sorted({b for b, ids in enumerate(buckets) for p in m.parameters(recurse=False)
                        if id(p) in ids}) for i, m in enumerate(model)}
    return {"events": events, "stale": stale, "updated": updated, "where": where}


def misc_probe(rank: int) -> dict:
    """A parameter without gradient, and broadcast_params."""
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    buckets = GradBuckets([used, unused], dist.group.WORLD, LARGE)
    buckets.start_sync()
    (used * (rank + 1)).sum().backward()
    buckets.finish_sync()
    tensors = [torch.full((4,), float(rank)), torch.full((2, 2), 10.0 + rank)]
    broadcast_params(tensors, dist.group.WORLD)
    return {"used": used.grad.clone(), "unused": unused.grad.clone(),
            "broadcast": [t.clone() for t in tensors]}


def to_numpy(obj):
    """Tensors (nested in dicts / lists / tuples) as numpy arrays, so results pickle plainly."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def to_torch(obj):
    """Inverse of :func:`to_numpy`."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_torch(v) for v in obj)
    return obj


def dp_worker(rank: int, dp: int, ckpt) -> dict:
    """Every scenario of ``dp`` on this rank (results as numpy, see :func:`to_numpy`)."""
    ckpt = to_torch(ckpt)
    group = dist.group.WORLD
    out: dict = {"runs": {}}
    for scenario in SCENARIOS[dp]:
        out["runs"][scenario], saved = train(scenario, group, rank, dp)
        if saved is not None:
            out["ckpt"] = saved
    if dp in RESUME_SCENARIOS:
        out["resumed"] = train(RESUME_SCENARIOS[dp], group, rank, dp, SAVE_AFTER, ckpt)[0]
    if dp == 2:
        out["overlap"] = {rs: overlap_probe(rank, dp, rs) for rs in (False, True)}
        out["no_overlap"] = overlap_probe(rank, dp, True, overlap=False)
        out["param_overlap"] = {o: param_overlap_run(rank, dp, o) for o in (False, True)}
        out["param_probe"] = param_gather_probe(rank, dp)
        out["misc"] = misc_probe(rank)
    return to_numpy(out)


# --------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run()


@pytest.fixture(scope="module")
def runs(reference):
    """``runs(dp)``: per-rank results of :func:`dp_worker` (DP=1 runs in this process)."""
    cache: dict[int, list] = {}

    def get(dp: int) -> list:
        if dp not in cache:
            ckpt = get(2)[0]["ckpt"] if dp != 2 else None
            results = ([dp_worker(0, 1, ckpt)] if dp == 1
                       else run_distributed(dp_worker, dp, ckpt))
            cache[dp] = to_torch(results)
        return cache[dp]

    return get


def assert_params_equal(actual: dict, expected: dict) -> None:
    for key, ref in expected.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(actual[key], ref, rtol=1e-6, atol=1e-6 * scale, msg=key)


# --------------------------------------------------------------------- tests
@pytest.mark.e2e
@pytest.mark.parametrize("dp,scenario", [(dp, s) for dp in (1, 2, 3) for s in SCENARIOS[dp]],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else f"dp{v}")
def test_matches_single_process_reference(runs, reference, dp, scenario):
    for result in runs(dp):
        for step, params in enumerate(result["runs"][scenario]):
            assert_params_equal(params, reference["params"][step])


@pytest.mark.e2e
def test_overlap_launches_during_backward(runs):
    for events in runs(2)[0]["overlap"].values():
        n_buckets = int(events[-1].split()[1])
        assert n_buckets >= 3
        first_done = events.index("backward done")
        last_done = len(events) - 2
        assert "launch" not in events[:first_done]  # first micro-batch only accumulates
        last_backward = events[first_done + 1:last_done]
        grads = [i for i, e in enumerate(last_backward) if e.startswith("grad")]
        launches = [i for i, e in enumerate(last_backward) if e == "launch"]
        assert len(launches) == n_buckets  # every bucket launched inside backward
        assert launches[0] < grads[-1]  # the first launch precedes the last gradient
        assert last_backward[grads[-1]] == "grad 0.weight"  # backward order: first layer last


@pytest.mark.e2e
def test_without_overlap_grad_reduce_buckets_launch_after_backward(runs):
    events = runs(2)[0]["no_overlap"]
    last_done = len(events) - 1 - events[::-1].index("backward done")
    assert events.count("backward done") == 2
    launches = [i for i, e in enumerate(events) if e == "launch"]
    assert len(launches) == int(events[-1].split()[1]) >= 3
    assert min(launches) > last_done  # finish_sync launches them all, after backward


@pytest.mark.e2e
def test_overlap_param_gather_gives_identical_results(runs):
    for result in runs(2):
        sync, overlapped = result["param_overlap"][False], result["param_overlap"][True]
        for a, b in zip(sync["losses"], overlapped["losses"]):
            assert torch.equal(a, b)
        for key, value in sync["params"].items():
            assert torch.equal(overlapped["params"][key], value), key


@pytest.mark.e2e
def test_overlap_param_gather_is_asynchronous_and_waits_in_forward_pre_hooks(runs):
    for result in runs(2):
        probe = result["param_probe"]
        events, where = probe["events"], probe["where"]
        done = events.index("step done")
        n_buckets = sum(e.startswith("launch") for e in events)
        assert n_buckets >= 3
        # the step only issues the all-gathers, last bucket (first used) first ...
        assert events[:done] == [f"launch {b}" for b in reversed(range(n_buckets))]
        assert probe["stale"] and probe["updated"]
        # ... and each module waits for its own buckets just before its forward
        expected = []
        for module, buckets in where.items():
            expected += [f"wait {b}" for b in sorted(buckets, reverse=True)
                         if f"wait {b}" not in expected]
            expected.append(f"forward {module}")
        assert events[done + 1:] == expected
        first_forward = events.index("forward 0")
        assert any(e.startswith("wait") for e in events[first_forward:])  # later buckets arrive


@pytest.mark.e2e
def test_named_state_matches_torch_format(runs, reference):
    """The DP=2 runs' optimizer state, named as torch's AdamW names it, is the reference's.

    Each gradient entry sums the GLOBAL_BATCH samples' terms, in micro-batches and over ranks
    here and in one batch in the reference; Adam's moments inherit that rounding, whose size is
    the tensor's scale, not each element's (an entry that nearly cancels is no more exact than
    a large one). Hence summation_atol: 2 (GLOBAL_BATCH - 1) ulp of fp32 at the tensor's
    largest magnitude, 22 ulp; 199 random summation orders of the reference came within 7.
    The element-wise rtol covers the roundings relative to each element (clipping's scale,
    the moments' update)."""
    ref_params, ref_state = reference["ckpt"]
    for result in runs(2):
        params, state = result["ckpt"]
        assert_params_equal(params, ref_params)
        assert state.keys() == ref_state.keys()
        for key, ref in ref_state.items():
            assert state[key].shape == ref.shape and state[key].dtype == ref.dtype, key
            atol = summation_atol(ref, GLOBAL_BATCH)
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=atol, msg=key)


@pytest.mark.e2e
@pytest.mark.parametrize("dp", [1, 3])
def test_resume_under_other_layout(runs, reference, dp):
    """Saved by ZeRO at DP=2; DP=1 replicated AdamW and DP=3 ZeRO continue identically."""
    for result in runs(dp):
        for i, params in enumerate(result["resumed"]):
            assert_params_equal(params, reference["params"][SAVE_AFTER + i])


@pytest.mark.e2e
def test_missing_grads_and_broadcast(runs):
    for result in runs(2):
        misc = result["misc"]
        assert torch.equal(misc["used"], torch.full((3,), 3.0))  # 1 + 2 summed over ranks
        assert torch.equal(misc["unused"], torch.zeros(2))
        assert torch.equal(misc["broadcast"][0], torch.zeros(4))
        assert torch.equal(misc["broadcast"][1], torch.full((2, 2), 10.0))
