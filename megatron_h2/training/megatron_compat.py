"""Megatron-LM flags that ``pretrain_gpt.py`` does not implement, and why.

Megatron-LM's GPT scripts and functional tests use a few hundred flags. Those that megatron_h2
implements are fields of the config dataclasses (``megatron_h2/config/``); those it accepts
without effect are :data:`megatron_h2.training.arguments.COMPAT_FLAGS` (reported at start-up).
Every other Megatron flag a user is likely to pass is listed here with the reason it is refused,
so the error is one line that says why instead of "unknown flag". ``docs/megatron_compat.md`` is
generated from these tables and the parser by ``tools/megatron_compat.py``.
"""

from __future__ import annotations

_MOE = "mixture-of-experts layers are not implemented (megatron_h2 trains dense GPT models)"
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
    "--num-experts": _MOE,
    "--expert-model-parallel-size": _MOE,
    "--expert-tensor-parallel-size": _MOE,
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
    "--use-checkpoint-args": "give the model flags; a checkpoint is checked against them",
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
