"""--bf16 as Megatron-LM runs it: bf16 weights (and activations), fp32 main weights in the
optimizer, fp32 gradient accumulation (bf16 with --grad-reduce-in-bf16), for the replicated and
the distributed optimizer; checkpoints hold the fp32 main weights, so a bf16 run resumes exactly
and its checkpoints load under fp32.

Tolerance of bf16 / fp16 against fp32 (one process, 30 iterations of the tiny model): one
rounding of the loss in that dtype, its unit roundoff (bf16 2^-9 = 1.95e-3, fp16 2^-11 =
4.9e-4) relative. The model differs from fp32 only by rounding (weights, activations, bf16
matrix products accumulated in fp32), which averages out over the batch's tokens; measured:
bf16 at most 9.1e-4 over 50 iterations, fp16 1.1e-4.
"""

import pytest
import torch
from safetensors import safe_open
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.distributed.grad_sync import GradBuckets
from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters
from megatron_h2.optimizer import build_data_parallel_optimizer
from megatron_h2.training.arguments import config_from_args
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags, records

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("grad_dtype, expected", [(FP32, 1 + 2**-9), (BF16, 1.0)],
                         ids=["fp32_buckets", "bf16_buckets"])
def test_bf16_gradients_accumulate_in_the_buckets_dtype(grad_dtype, expected):
    """Two micro-batches with gradients 1 and 2^-9: fp32 buckets keep the sum, bf16 ones (as
    --grad-reduce-in-bf16) round it away, as bf16 accumulation would. With fp32 buckets the
    bf16 weight's own .grad is freed after each backward (Megatron's main_grad)."""
    weight = nn.Parameter(torch.ones(1, dtype=BF16))
    buckets = GradBuckets([weight], None, grad_dtype=grad_dtype)
    for factor in (1.0, 2**-9):
        (weight * factor).sum().backward()
        assert (weight.grad is None) == (grad_dtype == FP32)
    buckets.finish_sync()
    assert weight.main_grad.dtype == grad_dtype
    assert weight.main_grad.item() == expected
    buckets.zero_grad()
    assert weight.main_grad.item() == 0.0


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_fp32_main_weights_keep_updates_below_bf16_resolution(distributed):
    """Adam's first steps move a weight of 1 by about lr = 1e-4 each, far below bf16's spacing
    there (2^-8 below 1): the fp32 main weight moves, the bf16 weight is always the main weight
    rounded, and it moves once the steps add up."""
    model = nn.Linear(4, 4, bias=False)
    nn.init.ones_(model.weight)
    cast_parameters(model, BF16)
    opt = build_data_parallel_optimizer(model, OptimizerConfig(lr=1e-4, weight_decay=0.0),
                                        None, use_distributed_optimizer=distributed)
    for step in range(1, 41):
        opt.zero_grad()
        model(torch.ones(2, 4, dtype=BF16)).sum().backward()
        opt.grad_buckets.finish_sync()
        opt.step()
        main = opt.main_weights()[model.weight]
        assert main.dtype == FP32 and torch.equal(model.weight.detach(), main.to(BF16))
        if step == 1:
            assert bool((main < 1.0).all()) and bool((model.weight == 1.0).all())
    assert bool((model.weight < 1.0).all())  # 40 steps of ~1e-4 cross the bf16 spacing


def _bf16_model_steps(distributed: bool, steps: int = 3) -> dict[str, torch.Tensor]:
    run = config_from_args("--bf16 --lr 3e-3 --num-layers 2 --hidden-size 64 "
                           "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                           "--hidden-dropout 0 --attention-dropout 0".split())[0]
    cfg = run.model
    cfg.vocab_size = 256
    model = GPTModel(cfg)
    init_parameters(model, cfg, 7)
    cast_parameters(model, BF16)
    opt = build_data_parallel_optimizer(model, run.optimizer, None,
                                        use_distributed_optimizer=distributed)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(2):  # two micro-batches accumulate
            tokens = torch.randint(0, 256, (2, cfg.seq_length + 1), generator=gen)
            model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        opt.grad_buckets.finish_sync()
        opt.clip_(0.5)
        opt.step()
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: w.clone() for p, w in opt.main_weights().items()}


def test_replicated_and_distributed_optimizers_agree_bitwise_in_bf16():
    """The same AdamW on the same fp32 main weights and gradients, whole or in shard pieces."""
    replicated, zero1 = _bf16_model_steps(False), _bf16_model_steps(True)
    assert replicated.keys() == zero1.keys()
    for name in replicated:
        assert torch.equal(replicated[name], zero1[name]), name


@pytest.mark.parametrize("precision, tolerance", [("--bf16", 2**-9), ("--fp16", 2**-11)])
def test_bf16_and_fp16_track_fp32(corpus, tmp_path, precision, tolerance):
    """Losses of 30 iterations within one rounding of the loss in that dtype (see the module
    docstring); fp16 starts at a scale that does not overflow so every step updates."""
    common = ["--train-iters", "30", "--log-interval", "1", "--eval-iters", "0"]
    assert main(flags(corpus, tmp_path / "fp32", *common)) == 0
    extra = [precision] + (["--initial-loss-scale", "65536"] if precision == "--fp16" else [])
    assert main(flags(corpus, tmp_path / "low", *common, *extra)) == 0
    want, got = records(tmp_path / "fp32"), records(tmp_path / "low")
    assert sorted(got) == sorted(want) == list(range(1, 31))
    worst = max(abs(got[i] - want[i]) / want[i] for i in want)
    assert 0 < worst <= tolerance  # close, and really computed in the lower precision
    assert got[30] < got[1] - 1.0  # and it learns


def _model_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for part in sorted(path.glob("model_*.safetensors")):
        with safe_open(str(part), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_bf16_resumes_exactly_and_its_checkpoint_loads_under_fp32(corpus, tmp_path,
                                                                  distributed):
    """20 iterations straight equal 10 + 10 resumed (bitwise): the checkpoint holds the fp32
    main weights (not bf16 values), which an fp32 run loads and trains on."""
    common = ["--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
              "--train-iters", "20", "--bf16"]
    common += ["--use-distributed-optimizer"] if distributed else []
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(flags(corpus, straight, *common)) == 0
    ckpt = resumed / "ckpt"
    assert main(flags(corpus, resumed, *common, "--save", str(ckpt), "--exit-interval", "10")) == 0
    weights = _model_tensors(ckpt / "iter_0000010")
    assert {t.dtype for t in weights.values()} == {FP32}
    matrix = weights["decoder.layers.0.mlp.linear_fc1.weight"]
    assert not torch.equal(matrix, matrix.to(BF16).float())  # fp32 main weights, not bf16
    assert main(flags(corpus, resumed, *common, "--save", str(ckpt), "--load", str(ckpt))) == 0
    assert records(resumed) == records(straight)
    assert records(resumed, "val_loss") == records(straight, "val_loss")
    fp32 = tmp_path / "fp32"
    assert main(flags(corpus, fp32, "--log-interval", "1", "--eval-iters", "0",
                      "--train-iters", "20", "--exit-interval", "12", "--load", str(ckpt),
                      "--ckpt-step", "10")) == 0
    assert sorted(records(fp32)) == [11, 12]
    assert abs(records(fp32)[11] - records(straight)[11]) <= 2**-9 * records(straight)[11]
