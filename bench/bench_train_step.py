"""Training-step throughput: megatron_h2's GPTModel vs transformers' LlamaForCausalLM, and
(``--compare precision``) megatron_h2's ``--bf16`` (bf16 weights, fp32 main weights and
gradients) vs bf16 autocast over fp32 weights.

Both models get the identical shape (vocabulary, hidden size, layers, heads, key/value heads,
FFN width, RoPE base 10000, RMSNorm epsilon, untied embeddings, no dropout), the same weights
(ours are initialised with ``init_parameters`` and copied into the HF layout), the same batch,
the same loss computation and the same AdamW settings. One step is
forward + per-token cross-entropy mean + backward + ``optimizer.step()`` + ``zero_grad()``.

The two are measured alternately in one process so that clock, thermal and background-load
drift hits both equally: after warm-up steps for each, every round runs ``--steps-per-round``
steps of one model then the same of the other (the order flips every round). Tokens/s is the
median over rounds; the ratio ours/HF is reported both as median(ours)/median(HF) and as the
median of the per-round ratios.

``--compare precision`` measures two of our steps the same way (alternating rounds, one
process): ``bf16`` is what ``pretrain_gpt.py --bf16`` runs (the model cast to bf16, the data-
parallel optimizer with fp32 main weights and fp32 gradient buckets, no autocast; the bf16
weights' gradients are added to the fp32 buckets by a hook), ``autocast`` is the fp32 model
under ``torch.autocast(bf16)`` with the fp32 optimizer (mixed precision by autocast). Same
weights, batch, loss and AdamW settings; it reports tokens/s of both, their ratio and the
model-state bytes each holds.

Examples::

    python bench/bench_train_step.py                       # tiny preset, CPU, ~1 minute
    python bench/bench_train_step.py --device cuda --preset 350m --bf16 --json out.jsonl
    python bench/bench_train_step.py --compare precision   # --bf16 vs autocast, CPU
    python bench/bench_train_step.py --compare precision --device cuda --preset 350m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megatron_h2.config import LLAMA_ARCHITECTURE, ModelConfig, OptimizerConfig
from megatron_h2.devices import get_accelerator
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel, init_parameters

PRESETS: dict[str, dict[str, int]] = {
    # Small enough for the whole default run (both models) to take about a minute on 2 CPU
    # cores, large enough that matmuls rather than Python overhead dominate the step.
    "tiny": dict(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                 num_query_groups=4, seq_length=256, vocab_size=8192, micro_batch_size=4,
                 rounds=30, steps_per_round=1, warmup=3, max_seconds=45),
    # ~350M parameters (LLaMA-style), meant for one GPU with --bf16.
    "350m": dict(num_layers=24, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                 num_query_groups=16, seq_length=2048, vocab_size=32000, micro_batch_size=8,
                 rounds=10, steps_per_round=5, warmup=5, max_seconds=0),
}
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "seq_length", "vocab_size", "micro_batch_size", "rounds",
               "steps_per_round", "warmup")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", choices=tuple(PRESETS), default="tiny",
                   help="default shape; any explicit shape flag below overrides it")
    p.add_argument("--compare", choices=("hf", "precision"), default="hf",
                   help="hf: ours vs transformers' Llama; precision: our --bf16 (bf16 weights, "
                        "fp32 main) vs bf16 autocast on fp32 weights")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for both models "
                   "(--compare hf)")
    for name in SHAPE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help="(preset value when omitted)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's current setting)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop timing after the round that passes this many seconds (at least "
                        "3 rounds run); 0 = no limit (preset value when omitted)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--order", choices=("alternate", "ours-first", "hf-first"),
                   default="alternate", help="which model runs first in each round")
    p.add_argument("--hf-loss", choices=("same", "builtin"), default="same",
                   help="same: HF logits through the identical per-token cross-entropy as ours; "
                        "builtin: pass labels= to LlamaForCausalLM (it shifts labels itself)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="device peak for MFU on cuda (989 = H100/H200 dense bf16)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, profile STEPS steps of each model with torch.profiler "
                        "and print the top operators")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="append one JSON line of results to FILE")
    args = p.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# --------------------------------------------------------------------------------------------
# Models


def build_ours(config: ModelConfig, accelerator, seed: int) -> torch.nn.Module:
    model = GPTModel(config, kernels=accelerator.kernels)
    init_parameters(model, config, seed)
    return model.to(accelerator.device).train()


def build_hf(config: ModelConfig, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
        initializer_range=config.init_method_std,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    hf_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_config)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"HF model uses attention implementation {impl!r}, expected 'sdpa'")
    return model.to(device).train()


@torch.no_grad()
def copy_weights_to_hf(ours: torch.nn.Module, hf: torch.nn.Module, config: ModelConfig) -> None:
    """Load our parameters into the HF layout so both start from the same point.

    Our ``linear_qkv`` rows are grouped per query group: [q heads of group g | k_g | v_g];
    ``linear_fc1`` rows are [gate | up].
    """
    nh, ng, d, f = (config.num_attention_heads, config.num_query_groups, config.kv_channels,
                    config.ffn_hidden_size)
    h = config.hidden_size
    hf.model.embed_tokens.weight.copy_(ours.embedding.word_embeddings.weight)
    hf.lm_head.weight.copy_(ours.output_layer.weight)
    hf.model.norm.weight.copy_(ours.decoder.final_layernorm.weight)
    for i, hf_layer in enumerate(hf.model.layers):
        layer = ours.decoder.layers[str(i)]
        qkv = layer.self_attention.linear_qkv.weight.view(ng, nh // ng + 2, d, h)
        hf_layer.self_attn.q_proj.weight.copy_(qkv[:, : nh // ng].reshape(nh * d, h))
        hf_layer.self_attn.k_proj.weight.copy_(qkv[:, nh // ng].reshape(ng * d, h))
        hf_layer.self_attn.v_proj.weight.copy_(qkv[:, nh // ng + 1].reshape(ng * d, h))
        hf_layer.self_attn.o_proj.weight.copy_(layer.self_attention.linear_proj.weight)
        fc1 = layer.mlp.linear_fc1.weight
        hf_layer.mlp.gate_proj.weight.copy_(fc1[:f])
        hf_layer.mlp.up_proj.weight.copy_(fc1[f:])
        hf_layer.mlp.down_proj.weight.copy_(layer.mlp.linear_fc2.weight)
        hf_layer.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        hf_layer.post_attention_layernorm.weight.copy_(layer.pre_mlp_layernorm.weight)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, fused: bool):
    """AdamW as megatron_h2 trains: 1-D parameters (norm scales) get no weight decay, betas and
    eps from OptimizerConfig; fused where the accelerator's kernels say so, else foreach.
    Built the same way for both models."""
    defaults = OptimizerConfig()
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=args.lr,
                             betas=(defaults.adam_beta1, defaults.adam_beta2),
                             eps=defaults.adam_eps, **impl)


# --------------------------------------------------------------------------------------------
# Steps


def make_step(kind: str, model, optimizer, tokens, labels, autocast_ctx, hf_loss: str):
    """Return a closure running one full training step and returning the loss tensor."""

    def loss_ours() -> torch.Tensor:
        return model(tokens=tokens, labels=labels).mean()

    def loss_hf() -> torch.Tensor:
        if hf_loss == "builtin":
            return model(input_ids=tokens, labels=labels, use_cache=False).loss
        logits = model(input_ids=tokens, use_cache=False).logits  # [b, s, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               reduction="none").mean()

    compute_loss = loss_ours if kind == "ours" else loss_hf

    def step() -> torch.Tensor:
        with autocast_ctx():
            loss = compute_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def bf16_steps(config: ModelConfig, accelerator, args: argparse.Namespace, tokens, labels
               ) -> tuple[dict[str, object], dict[str, torch.nn.Module], dict[str, object]]:
    """``--compare precision``: (steps, models, optimizers) of our ``--bf16`` training step and
    of bf16 autocast over fp32 weights, from the same initial weights."""
    from megatron_h2.models.gpt import cast_parameters
    from megatron_h2.optimizer import build_data_parallel_optimizer

    cfg = OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay)
    models, opts, steps = {}, {}, {}
    for name in ("bf16", "autocast"):
        model = build_ours(config, accelerator, args.seed)
        if name == "bf16":
            cast_parameters(model, torch.bfloat16)
        opt = build_data_parallel_optimizer(model, cfg, None, kernels=accelerator.kernels)
        models[name], opts[name] = model, opt

        def step(model=model, opt=opt, autocast=name == "autocast") -> torch.Tensor:
            opt.zero_grad()
            with accelerator.autocast(autocast):
                loss = model(tokens=tokens, labels=labels).mean()
            loss.backward()
            opt.grad_buckets.finish_sync()
            opt.step()
            return loss.detach()

        steps[name] = step
    return steps, models, opts


def alternate_rounds(steps: dict, names: tuple[str, str], args: argparse.Namespace,
                     tokens_per_step: int, accelerator) -> tuple[dict, dict, int, float]:
    """Warm-up, then rounds of ``--steps-per-round`` steps of each of ``names`` (order per
    ``--order``, "ours-first" meaning the first name); returns tokens/s per round, peak memory
    (GiB, where the device reports it), rounds run and seconds."""
    sync = accelerator.synchronize
    for _ in range(args.warmup):  # allocator, kernel selection, optimizer state creation
        for name in names:
            steps[name]()
    sync()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    peak_mem: dict[str, float] = {n: 0.0 for n in names}
    bench_start = time.perf_counter()
    rounds_done = 0
    first, second = names
    for r in range(args.rounds):
        if args.order == "alternate":
            order = names if r % 2 == 0 else (second, first)
        else:
            order = names if args.order == "ours-first" else (second, first)
        for name in order:
            accelerator.reset_peak_memory()
            seconds = timed_steps(steps[name], args.steps_per_round, sync)
            per_round[name].append(args.steps_per_round * tokens_per_step / seconds)
            peak_mem[name] = max(peak_mem[name],
                                 accelerator.memory_stats().get("peak_gib", 0.0))
        rounds_done = r + 1
        print(f"  round {r + 1}/{args.rounds}: {first} {per_round[first][-1]:,.0f} tok/s, "
              f"{second} {per_round[second][-1]:,.0f} tok/s, "
              f"ratio {per_round[first][-1] / per_round[second][-1]:.3f}", flush=True)
        if (args.max_seconds and rounds_done >= 3 and rounds_done < args.rounds
                and time.perf_counter() - bench_start > args.max_seconds):
            print(f"  time budget --max-seconds {args.max_seconds:g} reached: stopping after "
                  f"{rounds_done} of {args.rounds} rounds (machine busy or shape too large?)")
            break
    return per_round, peak_mem, rounds_done, time.perf_counter() - bench_start


def timed_steps(step, n: int, sync) -> float:
    """Seconds for n steps, device synchronised at both ends."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return time.perf_counter() - start


def profile_steps(name: str, step, n: int, sync, device_type: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync()
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync()
    sort_key = "cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
    print(f"\n=== profile: {name} ({n} steps, sorted by {sort_key}) ===")
    print(prof.key_averages().table(sort_by=sort_key, row_limit=25, max_name_column_width=50))


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    try:
        accelerator = get_accelerator(args.device)
        config = ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
            max_position_embeddings=args.seq_length, vocab_size=args.vocab_size,
            hidden_dropout=0.0, attention_dropout=0.0, group_query_attention=True,
            **LLAMA_ARCHITECTURE)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name in ("rounds", "steps_per_round", "micro_batch_size"):
        if getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if args.warmup < 0:
        print("error: --warmup must be >= 0", file=sys.stderr)
        return 2

    if args.compare == "precision":
        return compare_precision(args, accelerator, config)
    device = accelerator.device
    sync = accelerator.synchronize
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}")
    print(f"device: {accelerator.describe()}")
    if device.type == "cuda":
        print(f"gpu: {torch.cuda.get_device_name(device)}")
    print(f"threads: {threads} (torch.get_num_threads(); os.cpu_count()={os.cpu_count()})")

    torch.manual_seed(args.seed)
    ours = build_ours(config, accelerator, args.seed)
    hf = build_hf(config, device)
    copy_weights_to_hf(ours, hf, config)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    if n_ours != n_hf:
        print(f"error: parameter counts differ: ours {n_ours:,} vs HF {n_hf:,}", file=sys.stderr)
        return 1
    assert n_ours == config.num_parameters(), (n_ours, config.num_parameters())

    b, s = args.micro_batch_size, config.seq_length
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    tokens = data[:, :-1].contiguous().to(device)
    labels = data[:, 1:].contiguous().to(device)

    fused = accelerator.kernels.fused_adamw
    opt_ours = make_optimizer(ours, args, fused)
    opt_hf = make_optimizer(hf, args, fused)
    autocast_ctx = lambda: accelerator.autocast(args.bf16)  # noqa: E731
    steps = {
        "ours": make_step("ours", ours, opt_ours, tokens, labels, autocast_ctx, args.hf_loss),
        "hf": make_step("hf", hf, opt_hf, tokens, labels, autocast_ctx, args.hf_loss),
    }

    fpt = config.flops_per_token()
    tokens_per_step = b * s
    print(f"model: layers={config.num_layers} hidden={config.hidden_size} "
          f"ffn={config.ffn_hidden_size} heads={config.num_attention_heads} "
          f"kv_heads={config.num_query_groups} seq={s} vocab={config.vocab_size} "
          f"params={n_ours / 1e6:.2f}M flops/token={fpt / 1e9:.3f} GFLOP")
    print(f"step: micro_batch={b} tokens/step={tokens_per_step} "
          f"precision={'bf16 autocast' if args.bf16 else 'fp32'} "
          f"adamw={'fused' if fused else 'foreach'} hf_loss={args.hf_loss} "
          f"rounds={args.rounds} x {args.steps_per_round} steps (order: {args.order}), "
          f"warmup={args.warmup}")

    # Sanity check: identical weights and batch must give (nearly) the same first loss.
    # (--hf-loss builtin shifts labels again inside HF, so its loss is on a different target.)
    first_hf = None
    with torch.no_grad(), autocast_ctx():
        first_ours = ours(tokens=tokens, labels=labels).mean().item()
        if args.hf_loss == "same":
            logits = hf(input_ids=tokens, use_cache=False).logits
            first_hf = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()
            del logits
    if first_hf is None:
        print(f"initial loss: ours {first_ours:.5f}  (HF check skipped with --hf-loss builtin)")
    else:
        print(f"initial loss: ours {first_ours:.5f}  hf {first_hf:.5f}  "
              f"(|diff| {abs(first_ours - first_hf):.2e})")

    per_round, peak_mem, rounds_done, bench_seconds = alternate_rounds(
        steps, ("ours", "hf"), args, tokens_per_step, accelerator)

    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratios = [o / h for o, h in zip(per_round["ours"], per_round["hf"])]
    ratio = med["ours"] / med["hf"]
    ratio_paired = statistics.median(ratios)
    tflops = {k: v * fpt / 1e12 for k, v in med.items()}

    print("\nresults (median over rounds):")
    for name, label in (("ours", "megatron_h2 GPTModel"), ("hf", "HF LlamaForCausalLM")):
        line = (f"  {label:22s} {med[name]:12,.0f} tokens/s  "
                f"{1e3 * tokens_per_step / med[name]:9.1f} ms/step  "
                f"{tflops[name]:8.3f} model TFLOP/s")
        if device.type == "cuda":
            line += (f"  MFU {100 * tflops[name] / args.peak_tflops:5.1f}% "
                     f"(peak {args.peak_tflops:g})  peak mem {peak_mem[name]:.2f} GiB")
        print(line)
    best = {k: max(v) for k, v in per_round.items()}
    print(f"  spread ours {min(per_round['ours']):,.0f}..{best['ours']:,.0f}, "
          f"hf {min(per_round['hf']):,.0f}..{best['hf']:,.0f} tokens/s; "
          f"best-round ratio {best['ours'] / best['hf']:.3f}x")
    print(f"  ratio ours/HF: {ratio:.3f}x (median of per-round ratios {ratio_paired:.3f}x, "
          f"range {min(ratios):.3f}..{max(ratios):.3f})  "
          f"[{'OK' if ratio >= 1.0 else 'BELOW'} target >= 1.0x]")
    print(f"  timed section: {bench_seconds:.1f} s, {rounds_done} rounds")
    # A median far below the best round means other work competed for the device/cores.
    noisy = any(med[k] < 0.8 * best[k] for k in med)
    if noisy:
        print("  warning: noisy run (median tokens/s >20% below the best round); the machine "
              "looks busy - rerun when idle, or read the best-round ratio")

    if args.json:
        record = {
            "bench": "train_step",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": device.type,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or platform.machine()),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": threads,
            "preset": args.preset,
            "bf16": args.bf16,
            "hf_loss": args.hf_loss,
            "adamw": "fused" if fused else "foreach",
            "num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "ffn_hidden_size": config.ffn_hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_query_groups": config.num_query_groups, "seq_length": s,
            "vocab_size": config.vocab_size, "micro_batch_size": b,
            "params": n_ours,
            "rounds": rounds_done, "steps_per_round": args.steps_per_round,
            "warmup": args.warmup, "order": args.order,
            "flops_per_token": fpt,
            "ours_tokens_per_s": med["ours"], "hf_tokens_per_s": med["hf"],
            "ours_tflops": tflops["ours"], "hf_tflops": tflops["hf"],
            "ratio": ratio, "ratio_paired_median": ratio_paired,
            "noisy": noisy,
            "ours_best_tokens_per_s": best["ours"], "hf_best_tokens_per_s": best["hf"],
            "ours_rounds": per_round["ours"], "hf_rounds": per_round["hf"],
            "initial_loss_ours": first_ours,
            "initial_loss_hf": first_hf,
        }
        if device.type == "cuda":
            record.update(peak_tflops=args.peak_tflops,
                          ours_mfu=tflops["ours"] / args.peak_tflops,
                          hf_mfu=tflops["hf"] / args.peak_tflops,
                          ours_peak_mem_gib=peak_mem["ours"], hf_peak_mem_gib=peak_mem["hf"])
        with open(args.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"wrote results to {args.json}")

    if args.profile > 0:
        for name in ("ours", "hf"):
            profile_steps(name, steps[name], args.profile, sync, device.type)
    return 0


def compare_precision(args: argparse.Namespace, accelerator, config: ModelConfig) -> int:
    """``--compare precision``: our --bf16 step against bf16 autocast over fp32 weights."""
    print(f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"device: {accelerator.describe()}")
    if accelerator.device.type == "cuda":
        print(f"gpu: {torch.cuda.get_device_name(accelerator.device)}")
    print(f"threads: {torch.get_num_threads()} (os.cpu_count()={os.cpu_count()}); load average "
          f"(1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    b, s = args.micro_batch_size, config.seq_length
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    tokens = data[:, :-1].contiguous().to(accelerator.device)
    labels = data[:, 1:].contiguous().to(accelerator.device)
    steps, models, opts = bf16_steps(config, accelerator, args, tokens, labels)
    fpt = config.flops_per_token()
    print(f"model: layers={config.num_layers} hidden={config.hidden_size} "
          f"ffn={config.ffn_hidden_size} heads={config.num_attention_heads} seq={s} "
          f"vocab={config.vocab_size} params={config.num_parameters() / 1e6:.2f}M; "
          f"micro_batch={b} tokens/step={b * s}; rounds={args.rounds} x "
          f"{args.steps_per_round} steps, warmup={args.warmup}")
    print("bf16: bf16 weights + fp32 main weights and gradient buckets (pretrain_gpt.py "
          "--bf16); autocast: fp32 weights under torch.autocast(bf16), fp32 optimizer")
    first = [steps[name]().item() for name in ("bf16", "autocast")]
    print(f"first-step loss: bf16 {first[0]:.5f}  autocast {first[1]:.5f}")
    per_round, peak_mem, rounds_done, seconds = alternate_rounds(
        steps, ("bf16", "autocast"), args, b * s, accelerator)
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratios = [x / y for x, y in zip(per_round["bf16"], per_round["autocast"])]
    from megatron_h2.config import Precision, state_bytes_per_param
    from megatron_h2.optimizer.main_params import allocated_state_bytes

    # measured (distinct storages after the steps) and what the planner's one definition says
    nbytes = {k: allocated_state_bytes(models[k], opts[k]) / config.num_parameters()
              for k in models}
    planned = {"bf16": state_bytes_per_param(Precision("bf16", "fp32")),
               "autocast": state_bytes_per_param(Precision())}
    print("\nresults (median over rounds):")
    for name in ("bf16", "autocast"):
        line = (f"  {name:9s} {med[name]:12,.0f} tokens/s  {1e3 * b * s / med[name]:9.1f} "
                f"ms/step  {med[name] * fpt / 1e12:8.3f} model TFLOP/s  model state "
                f"{nbytes[name]:.2f} bytes/param (planner: {planned[name]:.0f})")
        if accelerator.device.type == "cuda":
            line += f"  peak mem {peak_mem[name]:.2f} GiB"
        print(line)
    print(f"  ratio bf16/autocast: {med['bf16'] / med['autocast']:.3f}x (median of per-round "
          f"ratios {statistics.median(ratios):.3f}x, range {min(ratios):.3f}..{max(ratios):.3f})"
          f"  [{seconds:.1f} s, {rounds_done} rounds; load average after "
          f"{os.getloadavg()[0]:.2f}]")
    if args.json:
        record = {"bench": "train_step_precision", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "device": accelerator.device.type, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "preset": args.preset,
                  "params": config.num_parameters(), "micro_batch_size": b, "seq_length": s,
                  "bf16_tokens_per_s": med["bf16"], "autocast_tokens_per_s": med["autocast"],
                  "ratio": med["bf16"] / med["autocast"],
                  "ratio_paired_median": statistics.median(ratios),
                  "bf16_rounds": per_round["bf16"], "autocast_rounds": per_round["autocast"],
                  "bytes_per_param": nbytes, "planner_bytes_per_param": planned,
                  "load_average": os.getloadavg()}
        with open(args.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
