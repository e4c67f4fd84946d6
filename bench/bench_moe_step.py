"""MoE training-step throughput: megatron_h2's GPTModel with MoE layers vs transformers'
MixtralForCausalLM of the same config, on CPU, and the token dispatch's share of our step.

Both models get the identical shape (Mixtral-style: RMSNorm, rotary, SwiGLU experts, top-k
softmax routing renormalised over the chosen experts, untied embeddings, no dropout, no aux
loss) and the same weights (ours are written as a Mixtral checkpoint by our converter and read
by ``from_pretrained``). One step is forward + per-token cross-entropy mean + backward +
AdamW ``step()`` + ``zero_grad()``, the same batch for both, torch's threads as set.

Our model runs three ways, each its own copy of the same weights: ``ours`` with a plain
``torch.optim.AdamW(foreach=True)`` over its parameters (as HF's), ``ours-dp`` with the
optimizer training builds (:func:`build_data_parallel_optimizer`: gradient buckets, Megatron's
parameter groups) over one tensor per expert, and ``ours-flat`` with the same optimizer whose
routed experts' weights are stepped over as flat tensors (``flat_experts``, the default in
training). The contenders are timed in turn in one process (warm-up steps for each, then rounds
of one step of each, the order rotating every round); tokens/s is the median over rounds, and
the ratios are medians of per-round ratios. The dispatch's share is the time of our
permutation of tokens to the experts and back (forward and backward, the router excluded)
timed alone on one micro-batch's routing, times the MoE layers, over our step time.

    python bench/bench_moe_step.py            # ~2-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_h2.checkpointing import save_checkpoint
from megatron_h2.checkpointing.hf import convert_megatron_to_hf
from megatron_h2.config import LLAMA_ARCHITECTURE, ModelConfig, OptimizerConfig, RunConfig
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.models.gpt.moe_layer import permute, unpermute
from megatron_h2.models.gpt.router import topk_routing
from megatron_h2.optimizer.distributed_optimizer import build_data_parallel_optimizer

CONTENDERS = ("ours", "ours-dp", "ours-flat", "hf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=352)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both models (default: torch's own)")
    return p.parse_args(argv)


def build(a: argparse.Namespace) -> tuple[list[GPTModel], torch.nn.Module, ModelConfig]:
    """Three copies of our model (same weights) and HF's Mixtral with those weights."""
    config = ModelConfig(**LLAMA_ARCHITECTURE, num_layers=a.num_layers,
                         hidden_size=a.hidden_size, num_attention_heads=8,
                         group_query_attention=True, num_query_groups=4,
                         ffn_hidden_size=a.moe_ffn_hidden_size, seq_length=a.seq_length,
                         vocab_size=a.vocab_size, num_experts=a.num_experts,
                         moe_router_topk=a.topk, hidden_dropout=0.0, attention_dropout=0.0)
    copies = []
    for _ in CONTENDERS[:-1]:
        copies.append(GPTModel(config))
        init_parameters(copies[-1], config, seed=1)
    ours = copies[0]
    from transformers import MixtralForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ours", 1, ours.state_dict(), None,
                        {"config": RunConfig(model=config).to_dict(), "consumed_samples": 0})
        convert_megatron_to_hf(Path(tmp) / "ours", Path(tmp) / "hf")
        hf = MixtralForCausalLM.from_pretrained(Path(tmp) / "hf", attn_implementation="sdpa")
    return [m.train() for m in copies], hf.train(), config


def stepper(model: torch.nn.Module, kind: str, tokens: torch.Tensor, labels: torch.Tensor):
    """One training step of ``kind`` (:data:`CONTENDERS`) on ``model``."""
    if kind in ("ours-dp", "ours-flat"):
        config = OptimizerConfig(lr=1e-4, weight_decay=0.01)
        opt = build_data_parallel_optimizer(model, config, None, overlap=False,
                                            flat_experts=kind == "ours-flat")
        update, zero = opt.step, opt.zero_grad
    else:
        torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        update, zero = torch_opt.step, lambda: torch_opt.zero_grad(set_to_none=True)

    def step() -> tuple[float, float]:
        """One step; returns (loss, seconds of the optimizer's step() + zero_grad())."""
        if kind == "hf":
            logits = model(input_ids=tokens).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        else:
            loss = model(tokens=tokens, labels=labels).mean()
        loss.backward()
        if kind in ("ours-dp", "ours-flat"):
            opt.grad_buckets.finish_sync()
        start = time.perf_counter()
        update()
        zero()
        return float(loss.detach()), time.perf_counter() - start

    return step


def dispatch_seconds(config: ModelConfig, tokens: int, repeats: int = 5) -> float:
    """Forward + backward of permute and unpermute for one MoE layer's micro-batch."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, config.hidden_size, generator=gen, requires_grad=True)
    logits = torch.randn(tokens, config.num_experts, generator=gen)
    _, routing_map = topk_routing(logits, config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        permuted, rows = permute(x, routing_map)
        unpermute(permuted, rows, tokens).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    ours, hf, config = build(a)
    gen = torch.Generator().manual_seed(2)
    batch = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=gen)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    steps = {kind: stepper(model, kind, tokens, labels)
             for kind, model in zip(CONTENDERS, [*ours, hf])}
    first = {name: step()[0] for name, step in steps.items()}
    for _ in range(a.warmup - 1):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    opt_times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(a.rounds):
        shift = r % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            start = time.perf_counter()
            opt_times[name].append(steps[name]()[1])
            times[name].append(time.perf_counter() - start)
    n_tokens = a.micro_batch_size * a.seq_length
    tps = {name: n_tokens / statistics.median(t) for name, t in times.items()}

    def paired(num: dict[str, list[float]], a_: str, b_: str) -> float:
        return statistics.median(x / y for x, y in zip(num[a_], num[b_]))

    share = dispatch_seconds(config, n_tokens) * len(config.moe_layers) \
        / statistics.median(times["ours-flat"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; layers "
          f"{a.num_layers}, hidden {a.hidden_size}, experts {a.num_experts} (top-{a.topk}, "
          f"ffn {a.moe_ffn_hidden_size}), seq {a.seq_length}, micro-batch {a.micro_batch_size}")
    print("first losses: " + "  ".join(f"{n} {first[n]:.6f}" for n in CONTENDERS))
    print("tokens/s: " + "  ".join(f"{n} {tps[n]:.0f}" for n in CONTENDERS) + f" ({a.rounds} "
          "rounds)")
    print("ratio to hf (median of per-round ratios): " + "  ".join(
        f"{n} {paired(times, 'hf', n):.2f}" for n in CONTENDERS[:-1]))
    print("median seconds of the step / of its optimizer step() + zero_grad(): " + "  ".join(
        f"{n} {statistics.median(times[n]):.3f} / {statistics.median(opt_times[n]):.3f}"
        for n in CONTENDERS))
    print(f"optimizer step() + zero_grad(), one tensor per expert / flat runs (median of "
          f"per-round ratios): {paired(opt_times, 'ours-dp', 'ours-flat'):.2f}; the whole step: "
          f"{paired(times, 'ours-dp', 'ours-flat'):.2f}")
    print(f"dispatch (permute + unpermute, fwd + bwd) share of our step: {100 * share:.1f}%")


if __name__ == "__main__":
    main()
