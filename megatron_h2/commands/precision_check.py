"""Operator precision alignment: run one training step of a model on a device, replay every
operator (forward, backward, optimizer) on a reference device / dtype, report the errors.

    # a bf16 autocast step (fp32 weights) against fp32 on the CPU, tiny model
    python tools/precision_check.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 32 --vocab-size 256 --micro-batch-size 2 --dtype bf16 \\
        --reference-dtype fp32 --output pc.json --plot pc.png
    # a GPU against the CPU (fp32 vs fp64), or a vendor plug-in's kernels against native ones
    python tools/precision_check.py [model flags] --device cuda --reference cpu
    MEGATRON_H2_PLUGINS=acme.accelerator python tools/precision_check.py --device acme ...
    # one stage of a plan (its layers; random hidden states stand in for its input)
    python tools/precision_check.py [model flags] --hetero-plan plan.yaml --stage 1

Model flags are pretrain_gpt.py's. Every ATen operator is replayed on the same inputs, so each
error is the operator's own; the accelerator's kernel-table functions (RMSNorm, SwiGLU: vendor
kernels where registered) are compared with the native kernels as a whole. An operator passes
when max |x - ref| <= atol + rtol * max |ref| with torch.testing's tolerances for its output
dtype. Prints a table per operator, the worst operator per layer and the first operator beyond
tolerance with its module; ``--output`` writes every call (key ``operators``), ``--plot`` the
error by layer. Exit status: 0 when every operator is within tolerance, 1 otherwise, 2 on bad
input.
"""

from __future__ import annotations

import argparse
import sys

from megatron_h2.errors import ConfigError


def _add_check_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision check")
    g.add_argument("--reference", default="cpu",
                   help="torch device the operators are replayed on (default cpu)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="precision of the checked step: fp32, or bf16 autocast with fp32 "
                        "weights (--bf16 training keeps bf16 weights; its runs check them "
                        "with --precision-check-interval) (default fp32)")
    g.add_argument("--reference-dtype", choices=["fp32", "fp64"], default="fp64",
                   help="precision of the replay (default fp64)")
    g.add_argument("--stage", type=int, help="with --hetero-plan: check this pipeline stage "
                   "(its layers, on its chip unless --device is given)")
    g.add_argument("--output", help="write the report as JSON (per-call records under "
                   "'operators')")
    g.add_argument("--plot", help="write a PNG of the worst error per layer")


def parse(argv: list[str] | None):
    """(check options, RunConfig): the model flags go through pretrain_gpt.py's parser."""
    from megatron_h2.training.arguments import build_parser, config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    full = build_parser()
    full.prog = "precision_check.py"
    full.description = __doc__.split("\n\n")[0]
    _add_check_flags(full)
    full.parse_args(argv)  # --help, and every flag's own check
    mine = argparse.ArgumentParser(add_help=False)
    _add_check_flags(mine)
    opts, rest = mine.parse_known_args(argv)
    cfg, _ = config_from_args(rest)
    return opts, cfg


def layer_range(opts, cfg) -> tuple[tuple[int, int] | None, str | None]:
    """(layers of the checked stage, its chip's device) from --hetero-plan / --stage."""
    from megatron_h2.plan.schema import HeteroPlan

    if opts.stage is None:
        return None, None
    if not cfg.parallel.hetero_plan:
        raise ConfigError("--stage needs --hetero-plan")
    plan = HeteroPlan.from_yaml(cfg.parallel.hetero_plan)
    plan.validate(cfg.model.num_layers, cfg.model.num_attention_heads,
                  cfg.model.num_query_groups)
    if plan.pipelines:
        raise ConfigError(f"--stage names a stage of one pipeline but the plan has "
                          f"{len(plan.pipelines)}; check a plan file of one of its pipelines")
    if not 0 <= opts.stage < plan.pipeline_parallel_size:
        raise ConfigError(f"--stage {opts.stage} is not a stage of the plan (0.."
                          f"{plan.pipeline_parallel_size - 1})")
    layers = plan.layer_ranges()[opts.stage]
    return (layers.start, layers.stop), plan.chips[plan.stages[opts.stage].chip].device


def main(argv: list[str] | None = None) -> int:
    from megatron_h2.devices import get_accelerator, load_plugins

    try:
        load_plugins()
        opts, cfg = parse(argv)
        layers, plan_device = layer_range(opts, cfg)
        vocab = cfg.data.vocab_size or 1024
        cfg.model.vocab_size = cfg.data.padded_vocab_size(vocab)
        acc = get_accelerator(cfg.training.device or plan_device or "cpu")
        import torch

        torch.empty(0, device=opts.reference)  # an unknown reference fails here, in one line
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: --reference {opts.reference}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 2
    from megatron_h2.monitoring.precision_monitor import check_training_step

    report = check_training_step(cfg.model, acc, dtype=opts.dtype, reference=opts.reference,
                                 reference_dtype=opts.reference_dtype,
                                 micro_batch_size=cfg.training.micro_batch_size,
                                 seed=cfg.training.seed, optimizer_cfg=cfg.optimizer,
                                 layer_range=layers)
    print(report.format())
    if opts.output:
        report.write_json(opts.output)
        print(f"report: {opts.output}")
    if opts.plot:
        report.plot(opts.plot)
        print(f"plot: {opts.plot}")
    return 1 if report.failed else 0

