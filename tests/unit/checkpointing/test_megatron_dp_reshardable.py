"""The distributed optimizer's flat-buffer layouts: torch_dist ``dp_reshardable`` (Megatron-LM's
default) and the legacy ``distrib_optim.pt``. The computed buffer layout matches the bucket
Megatron-Core saved, a model that would lay out differently is one line, and damaged or unread
variants of the fixtures' buffers, objects and files are each one line (the reading of the
fixtures themselves is compared with Megatron-Core's state in test_megatron_distopt.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from megatron_h2.checkpointing import megatron_distopt
from megatron_h2.checkpointing.hf_tensors import megatron_shapes
from megatron_h2.checkpointing.megatron_dist import read_dist_tensors
from megatron_h2.checkpointing.megatron_distopt import (
    PREFIX,
    buffer_layout,
    read_distrib_optim,
    read_dp_reshardable,
)
from megatron_h2.checkpointing.megatron_read import read_megatron
from megatron_h2.errors import ConfigError
from tests.helpers.paths import ROOT

DP_ITER = ROOT / "tests" / "fixtures" / "megatron" / "gpt_distopt" / "dp_reshardable" \
    / "iter_0000002"
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, " \
    "torch.float32).bucket_idx_0."


@pytest.fixture(scope="module")
def saved():
    """The fixture's optimizer tensors and object names, its model's shapes and its args."""
    state = read_megatron(DP_ITER, load_optim=False)
    tensors, objects = read_dist_tensors(DP_ITER)
    flat = {k: v for k, v in tensors.items() if k.startswith(PREFIX)}
    return flat, objects, megatron_shapes(state.config), state.args


def test_the_layout_ends_where_megatron_cores_bucket_does(saved):
    flat, _, shapes, _ = saved
    ((layout, end),) = buffer_layout(shapes, DP_ITER)
    assert end == flat[BUCKET + "param"].numel() == 8448  # per_bucket_numel_unpadded
    assert all(start % 64 == 0 for start, _ in layout.values())
    # reverse module order (the fixture ties its head to the embedding): the last first
    assert layout["decoder.final_layernorm.bias"][0] == 0
    assert max(layout.values())[0] == layout["embedding.word_embeddings.weight"][0]


def test_several_buckets_split_where_megatron_core_split_them(saved):
    """Megatron-Core's own split of the same model at --ddp-bucket-size 2000 (fixture
    dp_reshardable_buckets): the buckets close where the saved unpadded sizes say."""
    _, _, shapes, _ = saved
    unpadded = [2304, 2496, 2048, 1600]
    buckets = buffer_layout(shapes, DP_ITER, unpadded)
    assert [end for _, end in buckets] == unpadded
    assert sum(len(layout) for layout, _ in buckets) == len(shapes)
    where = DP_ITER.parent.parent / "dp_reshardable_buckets" / "iter_0000002"
    tensors, objects = read_dist_tensors(where)
    flat = {k: v for k, v in tensors.items() if k.startswith(PREFIX)}
    mains, _ = read_dp_reshardable(where, flat, objects, shapes, {})
    assert set(mains) == set(shapes)
    wider = {**shapes, "decoder.final_layernorm.bias": (80,)}  # bucket 0 would end later
    with pytest.raises(ConfigError, match=r"buckets of \[2304, 2496, 2048, 1600\]"):
        read_dp_reshardable(where, flat, objects, wider, {})


def _drop_bias(flat, objects, shapes, args):
    shapes = {k: v for k, v in shapes.items() if k != "decoder.final_layernorm.bias"}
    return flat, objects, shapes, args


def _rename(old: str, new: str) -> Callable:
    def change(flat, objects, shapes, args):
        flat = {k.replace(old, new): v for k, v in flat.items()}
        return flat, [k.replace(old, new) for k in objects], shapes, args
    return change


def _without(key: str) -> Callable:
    def change(flat, objects, shapes, args):
        return {k: v for k, v in flat.items() if not k.endswith(key)}, \
            [k for k in objects if key not in k], shapes, args
    return change


def _shorter(flat, objects, shapes, args):
    return {**flat, BUCKET + "exp_avg": flat[BUCKET + "exp_avg"][:-128]}, objects, shapes, args


def _all_shorter(flat, objects, shapes, args):
    return {k: v[:-128] for k, v in flat.items()}, objects, shapes, args


def _tp2(flat, objects, shapes, args):
    return flat, objects, shapes, {**args, "tensor_model_parallel_size": 2}


def _unknown_parameter(flat, objects, shapes, args):
    return flat, objects, {**shapes, "decoder.layers.0.mlp.router.weight": (4, 64)}, args


@pytest.mark.parametrize(("change", "says"), [
    (_drop_bias, r"buckets of \[8448\] elements.*lays out \[8384\]"),
    (_rename("bucket_idx_0", "bucket_idx_1"), r"has buckets \[1\]"),
    (_rename("gbuf_idx_0", "gbuf_idx_1"), "several buffers"),
    (_rename("shard_0_1", "shard_0_2"), "one of 2 pieces"),
    (_rename("dp_group_idx_0", "dp_group_idx_1"), r"model-parallel ranks \[1\], a TP 1 x PP 1"),
    (_without(".exp_avg_sq"), "no exp_avg_sq buffer"),
    (_without("per_bucket_numel_unpadded"), "no object per_bucket_numel_unpadded"),
    (_without("optimizer/shard_0_1"), "no object optimizer"),
    (_rename(".param", ".master"), "holds .*master of shape.*not a flat"),
    (_shorter, "buffers of different sizes"),
    (_all_shorter, r"buffers of \[8320\]"),
    (_tp2, "buffers of model-parallel ranks .0., a TP 2 x PP 1 run has 2"),
    (_unknown_parameter, "mlp.router.weight in the distributed optimizer's buffer is not known"),
])
def test_what_cannot_be_read_is_one_line(saved, change, says):
    flat, objects, shapes, args = change(*saved)
    with pytest.raises(ConfigError, match=says) as err:
        read_dp_reshardable(DP_ITER, flat, objects, shapes, args)
    assert "\n" not in str(err.value) and "--no-load-optim" in str(err.value)


@pytest.mark.parametrize(("extra", "args"), [(64, {}), (0, {"data_parallel_size": 5}),
                                           (0, {"ddp_pad_buckets_for_high_nccl_busbw": True})])
def test_bucket_padding_off_megatron_cores_rule_is_one_line(saved, monkeypatch, extra, args):
    """per_bucket_numel is the unpadded size padded to lcm(DP, 128) (x 2^16 for NCCL's bus
    bandwidth): saved [8448] for [8448] at DP 1; another size, or another DP, does not match."""
    flat, objects, shapes, saved_args = saved
    read = megatron_distopt.read_dist_objects

    def padded_more(where, keys):
        got = read(where, keys)
        for key in [k for k in got if k.endswith(".per_bucket_numel/shard_0_1")]:
            got[key] = [[{d: [n + extra for n in v] for d, v in got[key][0][0].items()}]]
        return got

    monkeypatch.setattr(megatron_distopt, "read_dist_objects", padded_more)
    with pytest.raises(ConfigError, match=r"padded buckets of \[\d+\] elements; Megatron-Core "
                       r"at DP \d pads \[8448\] to \[\d+\]"):
        read_dp_reshardable(DP_ITER, flat, objects, shapes, {**saved_args, **args})


def test_a_layout_shifted_by_one_parameter_would_not_match(saved):
    """The read is exact: the fixture's buffers taken at the computed offsets are the tensors;
    the same buffer read from another offset is not (the test would catch a wrong order)."""
    flat, objects, shapes, args = saved
    mains, state = read_dp_reshardable(DP_ITER, flat, objects, shapes, args)
    ((layout, _),) = buffer_layout(shapes, DP_ITER)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    start, stop = layout[name]
    assert torch.equal(mains[name].flatten(), flat[BUCKET + "param"][start:stop])
    assert not torch.equal(mains[name].flatten(), flat[BUCKET + "param"][start + 64:stop + 64])
    assert float(state[f"{name}.step"]) == 2.0


LEGACY_ITER = DP_ITER.parent.parent / "torch" / "iter_0000002"
DISTRIB = LEGACY_ITER / "mp_rank_00" / "distrib_optim.pt"
_DTYPES = (torch.float32, torch.float32)


def _edit(change: Callable) -> Callable:
    """A ``distrib_optim.pt`` content change, applied to a fresh copy of the saved dict."""
    def edit(saved):
        saved = {k: (dict(v) if k == 0 else v) for k, v in saved.items()}
        saved[0] = {d: dict(e) for d, e in saved[0].items()}
        change(saved)
        return saved
    return edit


@pytest.mark.parametrize(("change", "says"), [
    (_edit(lambda s: s.update(buckets_coalesced=False)), "not saved as flat coalesced"),
    (_edit(lambda s: s[0][_DTYPES].pop("exp_avg")), "not one buffer of param"),
    (_edit(lambda s: s.update({1: s[0]})), "not one buffer of param"),
    (_edit(lambda s: s[0][_DTYPES].update(numel_unpadded=8384)), r"buckets of \[8384\]"),
    (_edit(lambda s: s[0][_DTYPES].update(exp_avg=s[0][_DTYPES]["exp_avg"][:64])),
     "buffers of different sizes"),
    (_edit(lambda s: s[0][_DTYPES].update(param=s[0][_DTYPES]["param"].view(66, 128))),
     "not saved as flat"),
])
def test_a_damaged_distrib_optim_is_one_line(tmp_path, change, says):
    saved = change(torch.load(DISTRIB, weights_only=False))
    torch.save(saved, tmp_path / "distrib_optim.pt")
    with pytest.raises(ConfigError, match=says) as err:
        read_distrib_optim(tmp_path / "distrib_optim.pt", _legacy_optim(), _shapes(), {})
    assert "\n" not in str(err.value) and "distrib_optim.pt" in str(err.value)


@pytest.mark.parametrize(("args", "says"), [
    ({"context_parallel_size": 2}, "not read with context_parallel_size=2"),
    ({"decoder_first_pipeline_num_layers": 1}, "not read with decoder_first_pipeline"),
    ({"expert_model_parallel_size": 2}, "not read with expert_model_parallel_size=2"),
    ({"overlap_grad_reduce": True, "ddp_num_buckets": 4}, "--ddp-num-buckets 4"),
    ({"num_layers_per_virtual_pipeline_stage": 1}, "not read with num_layers_per_virtual"),
    # one bucket per parameter: concatenated unpadded, they are not the saved buffer
    ({"overlap_grad_reduce": True, "ddp_bucket_size": 10}, r"buckets of \[8448\].*lays out \[16, "),
])
def test_an_unread_legacy_layout_is_one_line(args, says):
    with pytest.raises(ConfigError, match=says):
        read_distrib_optim(DISTRIB, _legacy_optim(), _shapes(), args)


def test_a_truncated_distrib_optim_is_one_line(tmp_path):
    (tmp_path / "distrib_optim.pt").write_bytes(DISTRIB.read_bytes()[:5000])
    with pytest.raises(ConfigError, match="distrib_optim.pt is truncated or corrupt"):
        read_distrib_optim(tmp_path / "distrib_optim.pt", _legacy_optim(), _shapes(), {})


def test_with_overlap_grad_reduce_under_the_bucket_size_it_is_read():
    state = read_distrib_optim(DISTRIB, _legacy_optim(), _shapes(),
                               {"overlap_grad_reduce": True})
    assert set(state) == {f"{n}.{k}" for n in _shapes()
                          for k in ("main", "exp_avg", "exp_avg_sq", "step")}


def _legacy_optim():
    return torch.load(LEGACY_ITER / "mp_rank_00" / "model_optim_rng.pt",
                      weights_only=False)["optimizer"]


def _shapes():
    return megatron_shapes(read_megatron(LEGACY_ITER, load_optim=False).config)
