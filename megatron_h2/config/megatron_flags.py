"""The Megatron-LM flags ``pretrain_gpt.py`` does not implement: accepted without effect, or
refused, each with the reason.

A Megatron flag is one of three kinds here:

- supported: a field of a config dataclass (``megatron_h2/config/``), from which
  :mod:`megatron_h2.training.arguments` generates the parser;
- accepted without effect (:data:`COMPAT_FLAGS`): performance or infrastructure knobs of
  Megatron's own kernels, launchers and checkpoint writer that change nothing a run computes
  here; each is reported once at start-up with its reason;
- refused (:data:`UNSUPPORTED_FLAGS`, :data:`UNSUPPORTED_PREFIXES`): features megatron_h2 does
  not have, refused in one line that says why instead of "unknown flag".

A flag that changes the model or the math is never "without effect": it is supported or refused.
``docs/megatron_compat.md`` is generated from these tables and the parser by
``tools/megatron_compat.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoEffect:
    """A Megatron flag accepted without effect: why, and how Megatron parses it (whether it takes
    a value, and which values) so a command line that Megatron accepts is accepted here too."""

    reason: str
    takes_value: bool = False
    choices: tuple[str, ...] | None = None
    nargs: str | None = None


_GRAPHS = NoEffect("CUDA graphs are not captured; kernels are launched one by one")
_CKPT = ("megatron_h2 writes its own checkpoint format (safetensors parts, a JSON metadata file "
         "and a checksum manifest)")
_ASYNC = "how Megatron's background checkpoint worker runs; " + _CKPT
_GC = "Python's garbage collector keeps its default thresholds; a speed knob in Megatron"
_FUSION = "computed the same way fused or not"
_WGRAD = ("the embedding's weight gradient is computed in its backward (deferring it to the "
          "pipeline flush only hides latency in Megatron)")

COMPAT_FLAGS: dict[str, NoEffect] = {
    "--use-mcore-models": NoEffect("there is one model implementation (Megatron ignores it "
                                   "too)"),
    "--distributed-backend": NoEffect("each chip type's backend comes from the device layer",
                                      True, ("nccl", "gloo")),
    "--num-workers": NoEffect("samples are read from memory-mapped files in the training "
                              "process", True),
    "--no-create-attention-mask-in-dataloader": NoEffect("attention is causal inside SDPA; no "
                                                         "mask tensor is ever built"),
    "--attention-softmax-in-fp32": NoEffect("torch's scaled_dot_product_attention computes "
                                            "the softmax in fp32 already"),
    "--apply-query-key-layer-scaling": NoEffect(
        "Megatron divides Q.K^T by the layer number and multiplies it back inside its fp32 "
        "softmax, which leaves the attention weights unchanged; SDPA's softmax is in fp32 "
        "already"),
    "--openai-gelu": NoEffect("Megatron-Core ignores it too; the GeLU follows "
                              "--no-bias-gelu-fusion"),
    "--no-masked-softmax-fusion": NoEffect("attention runs through torch's SDPA"),
    "--no-bias-swiglu-fusion": NoEffect("SwiGLU is " + _FUSION),
    "--no-bias-dropout-fusion": NoEffect("bias, dropout and residual add are " + _FUSION),
    "--no-rope-fusion": NoEffect("rotary embeddings are " + _FUSION),
    "--no-persist-layer-norm": NoEffect("layer norms use torch's kernel (Megatron's persistent "
                                        "fused kernel is a speed knob)"),
    "--cross-entropy-loss-fusion": NoEffect("the loss is one (vocabulary-parallel under TP) "
                                            "cross entropy, " + _FUSION),
    "--cross-entropy-fusion-impl": NoEffect("the loss is one (vocabulary-parallel under TP) "
                                            "cross entropy, " + _FUSION, True, ("native", "te")),
    "--no-gradient-accumulation-fusion": NoEffect(
        "there is no fused weight-gradient accumulation kernel: gradients always take the "
        "unfused path this flag selects"),
    "--ddp-average-in-collective": NoEffect("gradients are averaged over the data-parallel "
                                            "ranks either way (the flag only moves Megatron's "
                                            "division into the collective)"),
    "--tp-comm-overlap": NoEffect("Transformer Engine's overlap of TP communication with GEMMs "
                                  "is not used; TP collectives run between the GEMMs"),
    "--tp-comm-overlap-cfg": NoEffect("Transformer Engine's TP communication overlap is not "
                                      "used", True),
    "--overlap-p2p-communication-warmup-flush": NoEffect(
        "pipeline sends and receives are not overlapped with the warm-up and flush compute"),
    "--overlap-param-gather-with-optimizer-step": NoEffect(
        "the first bucket's parameter all-gather is not started inside the optimizer step"),
    "--defer-embedding-wgrad-compute": NoEffect(_WGRAD),
    "--wgrad-deferral-limit": NoEffect(_WGRAD, True),
    "--cuda-graph-impl": NoEffect(_GRAPHS.reason, True,
                                  ("none", "local", "transformer_engine", "full_iteration")),
    "--cuda-graph-modules": NoEffect(_GRAPHS.reason, True, nargs="+"),
    "--cuda-graph-scope": NoEffect(_GRAPHS.reason, True, nargs="+"),
    "--cuda-graph-warmup-steps": NoEffect(_GRAPHS.reason, True),
    "--enable-cuda-graph": _GRAPHS,
    "--external-cuda-graph": _GRAPHS,
    "--te-rng-tracker": NoEffect("dropout draws from megatron_h2's per-rank generators "
                                 "(Megatron needs Transformer Engine's tracker for CUDA graphs "
                                 "only)"),
    "--manual-gc": NoEffect(_GC),
    "--manual-gc-interval": NoEffect(_GC, True),
    "--no-manual-gc-eval": NoEffect(_GC),
    "--empty-unused-memory-level": NoEffect("the allocator's cache is not emptied every "
                                            "iteration (a memory-fragmentation knob)", True,
                                            ("0", "1", "2")),
    "--deterministic-mode": NoEffect(
        "kernels are not switched to deterministic algorithms: runs on CPU are deterministic, "
        "GPU runs may differ between runs in the last bits"),
    "--disable-gloo-process-groups": NoEffect("megatron_h2 creates only the process groups it "
                                              "uses, on each chip type's backend"),
    "--use-tp-pp-dp-mapping": NoEffect("ranks are laid out tensor-parallel first, then data-"
                                       "parallel, then by pipeline stage (Megatron's default "
                                       "order); the other order only changes which chips talk"),
    "--check-weight-hash-across-dp-replicas-interval": NoEffect(
        "the check that data-parallel replicas hold equal weights is not run", True),
    "--rerun-mode": NoEffect("iterations are not re-run to validate results; the health checks "
                             "(--check-for-nan-in-loss-and-grad, ...) judge each step", True,
                             ("disabled", "validate_results", "report_stats")),
    "--straggler-minmax-count": NoEffect("Megatron's straggler detector is not implemented",
                                         True),
    "--log-progress": NoEffect("progress.txt is not written; each log line has the consumed "
                               "samples and the throughput"),
    "--use-dist-ckpt": NoEffect(_CKPT),
    "--dist-ckpt-format": NoEffect(_CKPT, True),
    "--dist-ckpt-strictness": NoEffect(
        _CKPT + "; loading checks every tensor's name and shape", True,
        ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
         "return_unexpected", "return_all", "ignore_all")),
    "--dist-ckpt-optim-fully-reshardable": NoEffect(
        "tensors are saved whole under global names, so every checkpoint loads under any TP, "
        "PP and DP"),
    "--dist-ckpt-workers": NoEffect(_ASYNC, True),
    "--ckpt-assume-constant-structure": NoEffect(_CKPT),
    "--ckpt-fully-parallel-load": NoEffect(_CKPT),
    "--ckpt-fully-parallel-save": NoEffect(_CKPT),
    "--no-ckpt-fully-parallel-save": NoEffect(_CKPT),
    "--use-persistent-ckpt-worker": NoEffect(_ASYNC),
    "--async-strategy": NoEffect(_ASYNC, True, ("nvrx", "mcore")),
    "--async-ckpt-use-cpu-shm": NoEffect(_ASYNC),
    "--no-position-embedding": NoEffect(
        "deprecated in Megatron, which accepts it only with --position-embedding-type rope, "
        "where it changes nothing"),
    "--moe-shared-expert-overlap": NoEffect(
        "the shared experts run before the routed experts; overlapping them with the token "
        "dispatch only reorders the sums of the input gradient"),
    "--moe-permute-fusion": NoEffect("the permutation of tokens to and from the experts is "
                                      + _FUSION),
    "--moe-router-fusion": NoEffect("the top-k routing and the aux loss are " + _FUSION),
    "--verify-integrity": NoEffect("checkpoints always carry SHA-256 checksums that loading "
                                   "verifies (turn off with --no-verify-checkpoint)"),
}
"""Megatron flags accepted without effect (said once at start-up)."""

_MOE = "this mixture-of-experts option is not implemented"
_ATTENTION = "this attention variant is not implemented (GPT / LLaMA attention with GQA only)"
_INFERENCE = "a text-generation / inference flag: pretrain_gpt.py only trains"
_RL = "reinforcement-learning post-training is not part of pretrain_gpt.py"
_FSDP = "FSDP is not implemented; shard the optimizer state with --use-distributed-optimizer"
_CP = "context parallelism is not implemented; split long sequences with TP and SP instead"
_EXPORT = "model export / distillation flags belong to Megatron's export tools"

UNSUPPORTED_PREFIXES: dict[str, str] = {
    "--moe-": _MOE,
    "--inference-": _INFERENCE,
    "--rl-": _RL,
    "--grpo-": _RL,
    "--dsa-": _ATTENTION,
    "--linear-": "linear-attention layers are not implemented",
    "--megatron-fsdp-": _FSDP,
    "--export-": _EXPORT,
    "--fim-": "fill-in-the-middle data is not implemented",
    "--incoming-requests-": _INFERENCE,
    "--error-injection-": "error injection is a Megatron test facility; use "
                          "MEGATRON_H2_INJECT_FAULT=RANK:ITER to rehearse failures",
}
"""Families of flags refused with one reason (a flag matches by prefix)."""

UNSUPPORTED_FLAGS: dict[str, str] = {
    "--multi-latent-attention": _ATTENTION,
    "--q-lora-rank": _ATTENTION,
    "--kv-lora-rank": _ATTENTION,
    "--qk-head-dim": _ATTENTION,
    "--qk-pos-emb-head-dim": _ATTENTION,
    "--v-head-dim": _ATTENTION,
    "--experimental-attention-variant": _ATTENTION,
    "--attention-output-gate": _ATTENTION,
    "--qk-layernorm": "layer norms on queries and keys are not implemented",
    "--apply-wd-to-qk-layernorm": "layer norms on queries and keys are not implemented",
    "--rotary-interleaved": "interleaved rotary embeddings are not implemented (rotate-half, as "
                            "LLaMA and Megatron's default)",
    "--use-mup": "muP parametrisation is not implemented",
    "--mup-base-hidden-size": "muP parametrisation is not implemented",
    "--cp-comm-type": _CP,
    "--hierarchical-context-parallel-sizes": _CP,
    "--use-torch-fsdp2": _FSDP,
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--num-distributed-optimizer-instances": "one distributed-optimizer instance per DP group",
    "--account-for-embedding-in-pipeline-split": "use --pipeline-layer-split (or "
                                                 "--decoder-first/last-pipeline-num-layers) to "
                                                 "balance the stages that hold the embedding",
    "--account-for-loss-in-pipeline-split": "use --pipeline-layer-split (or "
                                            "--decoder-first/last-pipeline-num-layers) to balance "
                                            "the stage that holds the loss",
    "--microbatch-group-size-per-virtual-pipeline-stage": "the interleaved schedule groups "
                                                          "micro-batches by the pipeline size "
                                                          "(Megatron's default)",
    "--eval-global-batch-size": "evaluation uses --global-batch-size",
    "--no-use-tokenizer-model-from-checkpoint-args": "give the model flags; a checkpoint is "
                                                     "checked against them",
    "--num-tokens-to-generate": _INFERENCE,
    "--prompts": _INFERENCE,
    "--prompt-file": _INFERENCE,
    "--prompt-file-num-truncate": _INFERENCE,
    "--temperature": _INFERENCE,
    "--top_k": _INFERENCE,
    "--top_p": _INFERENCE,
    "--top-n-logprobs": _INFERENCE,
    "--return-log-probs": _INFERENCE,
    "--output-path": _INFERENCE,
    "--stop-words": _INFERENCE,
    "--termination-id": _INFERENCE,
    "--max-tokens-to-oom": _INFERENCE,
    "--enable-chunked-prefill": _INFERENCE,
    "--flash-decode": _INFERENCE,
    "--decode-only-cuda-graphs": _INFERENCE,
    "--use-coordinator": _INFERENCE,
    "--use-legacy-static-engine": _INFERENCE,
    "--output-every-n-results": _INFERENCE,
    "--perform-rl-step": _RL,
    "--langrl-env-config": _RL,
    "--refit-method": _RL,
    "--test-mode": "a Megatron test facility",
    "--async-mode": _INFERENCE,
    "--use-flashinfer-fused-rope": _INFERENCE,
}
"""Single flags refused, with the reason."""


def unsupported_reason(flag: str) -> str | None:
    """Why ``flag`` (a Megatron flag megatron_h2 does not accept) is refused, or None."""
    if flag in UNSUPPORTED_FLAGS:
        return UNSUPPORTED_FLAGS[flag]
    for prefix, reason in UNSUPPORTED_PREFIXES.items():
        if flag.startswith(prefix):
            return reason
    return None
