"""Counting the model: parameters (per tensor-parallel rank), FLOPs and activation bytes.

:class:`ModelCounts` is a base of :class:`megatron_h2.config.ModelConfig`, the one model
description that the runtime builds and the planner plans for; its methods read only the
config's fields (sizes and architecture flags), for the architecture ``megatron_h2.models.gpt``
builds, on the padded vocabulary (``vocab_size`` is the size of the embedding and output layer).
"""

from __future__ import annotations

from typing import Literal

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
"""Activation recompute modes, fastest (and most memory-hungry) first."""


class ModelCounts:
    """Parameter, FLOP and memory counts of a :class:`~megatron_h2.config.ModelConfig`."""

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: the scale, plus the bias of a LayerNorm."""
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    @property
    def query_size(self) -> int:
        """Width of the query projection (and of the attention output): heads x head dim."""
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        """Width of the K (and of the V) projection: query groups x head dimension."""
        return self.num_query_groups * self.kv_channels

    @property
    def fc1_size(self) -> int:
        """Output width of the MLP's first layer: [gate | up] for SwiGLU, else the FFN size."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one layer's matrices: fused QKV, output projection, MLP fc1 and fc2."""
        h, q = self.hidden_size, self.query_size
        return h * (q + 2 * self.kv_size) + q * h + (self.fc1_size + self.ffn_hidden_size) * h

    def _layer_bias_params(self) -> tuple[int, int]:
        """(TP-sharded, replicated) bias elements of one layer's linear layers."""
        sharded = (self.query_size + 2 * self.kv_size) if self.add_qkv_bias else 0
        replicated = 0
        if self.add_bias_linear:
            sharded += self.fc1_size  # column-parallel fc1
            replicated += 2 * self.hidden_size  # row-parallel attention output and fc2
        return sharded, replicated

    @property
    def layer_params(self) -> int:
        """All parameters of one layer (matrices, biases and the two norms)."""
        sharded, replicated = self._layer_bias_params()
        return self.layer_matrix_params + sharded + replicated + 2 * self.norm_params

    def layer_params_per_chip(self, tp: int) -> float:
        """Parameters of one layer on one TP rank (matrices and their column-parallel biases
        split; norms and row-parallel biases replicated)."""
        sharded, replicated = self._layer_bias_params()
        return (self.layer_matrix_params + sharded) / tp + replicated + 2 * self.norm_params

    @property
    def position_embedding_params(self) -> int:
        """The learned position table (replicated over TP), or none."""
        if self.position_embedding_type != "learned_absolute":
            return 0
        return self.max_position_embeddings * self.hidden_size

    def embedding_params_per_chip(self, tp: int) -> float:
        """Vocabulary-parallel word embedding and position table on one TP rank."""
        return self.vocab_size * self.hidden_size / tp + self.position_embedding_params

    def head_params_per_chip(self, tp: int) -> float:
        """Final norm plus vocabulary-parallel output layer on one TP rank of the last stage.

        With tied embeddings the output weight counted here is the last stage's copy of the
        word embedding (pipeline parallelism); a single stage holds the tied weight once.
        """
        return self.vocab_size * self.hidden_size / tp + self.norm_params

    def num_parameters(self) -> int:
        """Parameters of the whole model (layers, embeddings, final norm, output layer), the
        tied embedding / output weight counted once."""
        output = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size \
            + self.position_embedding_params + self.norm_params + output \
            + self.moe_params_delta()

    def attention_core_flops_per_token(self, causal: bool = True) -> float:
        """QK^T and AV of one layer per token: 4 x seq x (heads x head dim) over the full square,
        half of it with the causal mask (the work a chip does)."""
        full = 4.0 * self.seq_length * self.query_size
        return full / 2 if causal else full

    def layer_forward_flops(self, tokens: int, causal: bool = True) -> float:
        """Forward FLOPs of one layer over ``tokens`` tokens (matrix multiplies + attention;
        biases, norms and activations are not counted)."""
        return tokens * (2.0 * self.layer_matrix_params
                         + self.attention_core_flops_per_token(causal))

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output layer (logits over the padded vocabulary)."""
        return tokens * 2.0 * self.hidden_size * self.vocab_size

    def layer_weight_grad_flops(self, tokens: int) -> float:
        """FLOPs of one layer's weight gradients (``dW = X^T dY`` of its four matrices): the part
        of the backward (2 x forward) that a zero-bubble schedule defers. The rest, the input
        gradients and the attention core's backward, is what the previous stage waits for."""
        return tokens * 2.0 * self.layer_matrix_params

    def head_weight_grad_flops(self, tokens: int) -> float:
        """FLOPs of the output layer's weight gradient (half of its backward)."""
        return self.head_forward_flops(tokens)

    def flops_per_token(self, causal: bool = False) -> float:
        """Training FLOPs of one token, forward + backward = 3 x forward, no recompute (a MoE
        layer's MLP counted as its router, top-k experts and shared experts).

        ``causal=False`` counts attention over the full square, as Megatron's model-TFLOP/s
        accounting does (the runtime's log line); the planner's MFU counts the causal half.
        """
        forward = self.num_layers * self.layer_forward_flops(1, causal) \
            + self.head_forward_flops(1) + 2.0 * self.moe_matrix_params_per_token_delta()
        return 3.0 * forward

    # ----------------------------------------------------------------------------- memory
    def layer_activation_bytes(self, tokens: int, tp: int, recompute: Recompute) -> float:
        """Bytes one layer keeps for backward per micro-batch of ``tokens`` tokens (bf16).

        ``none``: the inputs of every matrix multiply, the norms, the attention core and the
        MLP activation; ``selective``: the attention core and the activation are recomputed;
        ``full``: only the layer input is kept. Sharded parts are divided by TP.
        """
        h, f, q, kv, a = (self.hidden_size, self.ffn_hidden_size, self.query_size, self.kv_size,
                          self.num_attention_heads)
        fc1 = 2 * self.fc1_size  # the activation's input, bf16
        if recompute == "none":
            return tokens * (8 * h + (4 * q + 4 * kv + fc1 + 2 * f + 4 * a) / tp)
        if recompute == "selective":
            return tokens * (4 * h + (2 * q + 4 * kv + fc1) / tp)
        return tokens * 2.0 * h

    def layer_weight_grad_bytes(self, tokens: int, tp: int) -> float:
        """Bytes one layer keeps per micro-batch between its input gradient and its deferred
        weight gradient (zero-bubble): every matrix's input and output gradient, bf16, per TP
        rank (QKV: h in, (q + 2 kv) / t out; projection: q / t in, h out; fc1: h in, fc1 / t
        out; fc2: f / t in, h out). Bias gradients are reductions of the output gradients."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.query_size, self.kv_size
        return tokens * (8 * h + (4 * q + 4 * kv + 2 * self.fc1_size + 2 * f) / tp)

    def head_weight_grad_bytes(self, tokens: int, tp: int) -> float:
        """The same for the output layer: its input (h) and the logits' gradient (V / t), bf16."""
        return tokens * 2.0 * (self.hidden_size + self.vocab_size / tp)

    def embedding_weight_grad_bytes(self, tokens: int) -> float:
        """The same for the input embedding: the gradient of its output (h, bf16)."""
        return tokens * 2.0 * self.hidden_size

    def head_activation_bytes(self, tokens: int, tp: int) -> float:
        """Bytes the final norm, output layer and loss keep per micro-batch (bf16 in, fp32
        logits)."""
        return tokens * (4 * self.hidden_size + 6 * self.vocab_size / tp)
