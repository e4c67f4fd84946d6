"""Core attention kernels: which of torch's scaled_dot_product_attention backends may run
(``--attention-backend``), whether the chip can run the chosen one, and NVIDIA Transformer
Engine's attention (``--transformer-impl transformer_engine``) where that library imports.

Megatron's backends map onto torch's as follows (each is a fused or plain kernel of the same
causal attention, so the numbers agree within the kernels' rounding):

========== ============================================== =================================
backend    torch SDPA backends allowed                    Megatron (Transformer Engine)
========== ============================================== =================================
flash      FLASH_ATTENTION                                FlashAttention
fused      CUDNN_ATTENTION, then EFFICIENT_ATTENTION      cuDNN fused attention
unfused    MATH                                           unfused (PyTorch) attention
local      MATH                                           Megatron's own DotProductAttention
auto       any: torch picks per call                      Transformer Engine picks
========== ============================================== =================================

A backend that cannot run for the model on this chip (FlashAttention with dropout on the CPU,
for instance) is found by :func:`check_attention_backend` at start-up, not mid-training: torch
has no silent fallback once a backend list is given, and neither does megatron_h2.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS: dict[str, tuple[SDPBackend, ...] | None] = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "unfused": (SDPBackend.MATH,),
    "local": (SDPBackend.MATH,),
    "auto": None,
}

TE_BACKEND_ENV: dict[str, dict[str, str]] = {
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
    "auto": {},
}
"""How Megatron tells Transformer Engine which attention to use (its environment switches)."""


def sdpa_backends(backend: str) -> contextlib.AbstractContextManager:
    """The context under which SDPA calls may only use ``backend``'s kernels."""
    allowed = SDPA_BACKENDS[backend]
    return contextlib.nullcontext() if allowed is None else sdpa_kernel(list(allowed))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                     backend: str = "auto") -> torch.Tensor:
    """q: [b, nh, s, d]; k, v: [b, ng, s, d] -> [b, nh, s, d] (softmax scale 1/sqrt(d))."""
    with sdpa_backends(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                              enable_gqa=k.shape[1] != q.shape[1])


def check_attention_backend(backend: str, device: torch.device, dtype: torch.dtype,
                            heads: int, groups: int, head_dim: int,
                            dropout: float) -> str | None:
    """Run one small forward and backward of the model's attention (its dtype, head size,
    grouped heads and dropout) under ``backend`` on ``device``; None if it works, else why not
    (torch's own reason)."""
    if SDPA_BACKENDS[backend] is None:
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, heads, 16, head_dim)
    q = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    kv = [torch.randn((1, groups, 16, head_dim), generator=gen).to(device, dtype)
          .requires_grad_() for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:  # torch explains a refusal in warnings
        warnings.simplefilter("always")
        try:
            causal_attention(q, *kv, dropout, backend).float().sum().backward()
        except RuntimeError as exc:
            why = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return "; ".join([text, *dict.fromkeys(w for w in why if w and w[-1] != ":")])
    return None


class TECoreAttention(nn.Module):
    """Transformer Engine's causal ``DotProductAttention`` for this rank's heads, on the same
    tensors as :func:`causal_attention` (q: [b, nh, s, d]; k, v: [b, ng, s, d] -> [b, nh, s, d]);
    ``backend`` sets Transformer Engine's attention switches as Megatron does. Raises
    ImportError where Transformer Engine does not import."""

    def __init__(self, heads: int, groups: int, head_dim: int, dropout: float,
                 backend: str) -> None:
        super().__init__()
        import transformer_engine.pytorch as te  # optional, NVIDIA only

        os.environ.update(TE_BACKEND_ENV[backend])
        self.inner = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups,
                                            attention_dropout=dropout, qkv_format="bshd",
                                            attn_mask_type="causal")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, nh, s, d = q.shape
        out = self.inner(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                         v.transpose(1, 2).contiguous())  # [b, s, nh d]
        return out.view(b, s, nh, d).transpose(1, 2)
