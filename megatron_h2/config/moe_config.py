"""Mixture-of-experts fields of the model description (Megatron-LM's ``--num-experts`` and
``--moe-*`` flags, with Megatron's names and defaults), their checks, and which layers are MoE.

:class:`MoEFields` is a base of :class:`~megatron_h2.config.ModelConfig`: a model is a MoE
model when ``num_experts`` is set; layer ``i`` (0-based, global) has a MoE block instead of the
dense MLP when :meth:`MoEFields.is_moe_layer` says so (``--moe-layer-freq``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from megatron_h2.config.flags import flag
from megatron_h2.errors import ConfigError

ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
_UNIMPLEMENTED_BALANCING = ("global_aux_loss", "sinkhorn", "quantile_balancing")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
ROUTER_DTYPES = ("fp32", "fp64")


def _eval_pattern(node: ast.AST) -> int | list[int]:
    """Evaluate Megatron's layer-pattern expressions: int and list literals, ``+`` and ``*``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported expression")


def parse_moe_layer_freq(text: str | int | list[int]) -> int | list[int]:
    """``"2"`` -> 2 (one MoE layer every 2 layers); ``"([0]*1+[1]*3)"`` -> [0, 1, 1, 1] (1 = a
    MoE layer, 0 = a dense layer), as Megatron's ``moe_freq_type``."""
    if isinstance(text, (int, list)):
        return text
    hint = ("--moe-layer-freq takes an integer N (every N-th layer is MoE) or a list "
            "expression such as \"([0]*1+[1]*3)\"")
    try:
        value = _eval_pattern(ast.parse(text.strip(), mode="eval").body) if "[" in text \
            else int(text)
    except (SyntaxError, ValueError, TypeError):
        raise ConfigError(f"{hint}, got {text!r}") from None
    if isinstance(value, list) and not all(isinstance(v, int) and v in (0, 1) for v in value):
        raise ConfigError(f"{hint} of 0s and 1s, got {text!r}")
    if not isinstance(value, (int, list)):
        raise ConfigError(f"{hint}, got {text!r}")
    return value


@dataclass
class MoEFields:
    """Megatron-LM's mixture-of-experts flags (Megatron-Core's ``TransformerConfig`` fields of
    the same names; ``--num-experts`` is its ``num_moe_experts``)."""

    num_experts: int | None = flag(None, "Number of experts in each MoE layer (None: a dense "
                                   "model).")
    moe_ffn_hidden_size: int | None = flag(
        None, "Hidden size of each expert's MLP; default: --ffn-hidden-size.")
    moe_layer_freq: int | list[int] = flag(
        1, "Which layers are MoE: an integer N (layers 0, N, 2N, ... are MoE, the rest dense) "
        "or a list expression with one 0 (dense) or 1 (MoE) per layer, such as "
        "\"([0]*1+[1]*3)\".", parse=parse_moe_layer_freq, metavar="FREQ")
    moe_router_topk: int = flag(2, "Number of experts each token is routed to.")
    moe_router_score_function: str = flag(
        "softmax", "Score function of the router.", choices=ROUTER_SCORE_FUNCTIONS)
    moe_router_pre_softmax: bool = flag(
        False, "Apply the softmax (or sigmoid) before the top-k selection (default: softmax over "
        "the selected k logits).")
    moe_router_topk_scaling_factor: float | None = flag(
        None, "Multiply the top-k routing probabilities by this factor.")
    moe_router_load_balancing_type: str = flag(
        "aux_loss", "Load balancing: aux_loss (GShard / Switch, per micro-batch), seq_aux_loss "
        "(DeepSeek-V2, per sequence) or none.",
        choices=LOAD_BALANCING_TYPES + _UNIMPLEMENTED_BALANCING)
    moe_aux_loss_coeff: float = flag(0.0, "Scaling coefficient of the load-balancing loss "
                                     "(1e-2 is a good start).")
    moe_z_loss_coeff: float | None = flag(None, "Scaling coefficient of the router z-loss "
                                          "(1e-3 is a good start).")
    moe_router_enable_expert_bias: bool = flag(
        False, "Auxiliary-loss-free balancing: route on score + a per-expert bias that each step "
        "moves by --moe-router-bias-update-rate towards balance (sigmoid scores).")
    moe_router_bias_update_rate: float = flag(1e-3, "Update rate of the expert bias.")
    moe_router_num_groups: int | None = flag(
        None, "Group-limited routing: the experts form this many equal groups.")
    moe_router_group_topk: int | None = flag(
        None, "Group-limited routing: groups each token may be routed to.")
    moe_router_dtype: str | None = flag(
        None, "Compute the routing (and the weighting of expert outputs) in this dtype; "
        "default: the activations' dtype.", choices=ROUTER_DTYPES)
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "Hidden size of the shared experts (all of them together), which every token "
        "goes through; default: none.")
    moe_shared_expert_gate: bool = flag(
        False, "Scale the shared experts' output by a learned sigmoid gate per token "
        "(needs --moe-shared-expert-intermediate-size).")
    moe_expert_capacity_factor: float | None = flag(
        None, "Capacity of each expert as a factor of its even share of tokens; tokens beyond "
        "it are dropped (default: none dropped; negative: none, as Megatron).")
    moe_pad_expert_input_to_capacity: bool = flag(
        False, "Pad each expert's input to its capacity (needs --moe-expert-capacity-factor).")
    moe_token_drop_policy: str = flag(
        "probs", "Which tokens an expert over capacity drops: the lowest probabilities (probs) "
        "or the last ones in the micro-batch (position).", choices=TOKEN_DROP_POLICIES)
    moe_token_dispatcher_type: str = flag(
        "allgather", "How tokens reach the experts of other expert-parallel ranks: allgather "
        "(every rank gathers the EP group's tokens and the partial outputs are summed back) or "
        "alltoall (token counts exchanged, then each token sent to its experts' rank, no "
        "padding); with EP 1 both keep every token on its rank.",
        choices=TOKEN_DISPATCHER_TYPES)
    moe_grouped_gemm: bool = flag(
        False, "Megatron's grouped GEMM of the local experts; here the experts run one after "
        "the other either way, which computes the same numbers.")
    moe_per_layer_logging: bool = flag(False, "Log the aux and z losses of each MoE layer.")

    # ------------------------------------------------------------------ derived
    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.num_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has a MoE block (Megatron's pattern)."""
        if not self.is_moe:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return bool(freq[layer])
        return layer % freq == 0

    @property
    def moe_layers(self) -> list[int]:
        """The global indices of the MoE layers."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    # ------------------------------------------------------------------ counts
    def _mlp_params(self, ffn: int) -> tuple[int, int]:
        """(matrix, bias) parameters of one MLP of FFN size ``ffn`` (SwiGLU: fc1 is 2 x ffn)."""
        fc1 = 2 * ffn if self.swiglu else ffn
        bias = fc1 + self.hidden_size if self.add_bias_linear else 0
        return (fc1 + ffn) * self.hidden_size, bias

    def _moe_block(self) -> tuple[int, int]:
        """(all parameters, matrix parameters one token uses) of one MoE block: the router, the
        experts (top-k of them per token) and the shared experts."""
        e, h = self.num_experts, self.hidden_size
        router = e * h + (e if self.add_bias_linear else 0)
        matrix, bias = self._mlp_params(self.moe_ffn_hidden_size)
        shared_matrix = shared_bias = 0
        if self.moe_shared_expert_intermediate_size:
            shared_matrix, shared_bias = self._mlp_params(self.moe_shared_expert_intermediate_size)
            shared_bias += h if self.moe_shared_expert_gate else 0  # the gate's weight [1, h]
        total = router + e * (matrix + bias) + shared_matrix + shared_bias
        return total, e * h + self.moe_router_topk * matrix + shared_matrix

    def moe_params_delta(self) -> int:
        """Parameters the MoE blocks add to the model over dense MLPs in their layers."""
        if not self.is_moe:
            return 0
        dense = sum(self._mlp_params(self.ffn_hidden_size))
        return len(self.moe_layers) * (self._moe_block()[0] - dense)

    def moe_matrix_params_per_token_delta(self) -> int:
        """Matrix parameters one token uses in the MoE blocks beyond dense MLPs (for FLOPs)."""
        if not self.is_moe:
            return 0
        dense = self._mlp_params(self.ffn_hidden_size)[0]
        return len(self.moe_layers) * (self._moe_block()[1] - dense)

    # ------------------------------------------------------------ per-layer counts (planner)
    def _dense_mlp_per_chip(self, tp: int) -> float:
        """Parameters of one dense MLP on one TP rank (fc1 and its bias split, fc2's bias
        replicated), as :meth:`ModelCounts.layer_params_per_chip` counts them."""
        matrix, _ = self._mlp_params(self.ffn_hidden_size)
        bias = self.fc1_size / tp + self.hidden_size if self.add_bias_linear else 0.0
        return matrix / tp + bias

    def moe_layer_params_per_chip(self, tp: int, ep: int, etp: int | None = None
                                  ) -> tuple[float, float]:
        """(non-expert, expert) parameters of one MoE layer on one rank of a stage with TP
        ``tp``, expert parallelism ``ep`` and expert TP ``etp`` (default the stage's TP,
        Megatron's default): attention, norms, the router (replicated) and the shared experts
        (split by TP) sync over the DP group; the ``num_experts / ep`` local experts (split by
        ETP) over the expert-data-parallel group."""
        e, h = self.num_experts, self.hidden_size
        router = e * h + (e if self.add_bias_linear else 0)
        shared = 0.0
        if self.moe_shared_expert_intermediate_size:
            matrix, bias = self._mlp_params(self.moe_shared_expert_intermediate_size)
            shared = (matrix + bias) / tp + (h if self.moe_shared_expert_gate else 0)
        dense = self.layer_params_per_chip(tp) - self._dense_mlp_per_chip(tp) + router + shared
        matrix, bias = self._mlp_params(self.moe_ffn_hidden_size)
        return dense, e // ep * (matrix + bias) / (etp or tp)

    def moe_layer_forward_flops(self, tokens: int, causal: bool = True) -> tuple[float, float]:
        """(non-expert, expert) forward FLOPs of one MoE layer over ``tokens`` tokens: attention,
        router and shared experts; the top-k routed experts (``k`` expert MLPs per token)."""
        block_per_token = self._moe_block()[1]  # router + top-k experts + shared experts
        experts = self.moe_router_topk * self._mlp_params(self.moe_ffn_hidden_size)[0]
        dense_mlp = self._mlp_params(self.ffn_hidden_size)[0]
        rest = self.layer_forward_flops(tokens, causal) + 2.0 * tokens * (
            block_per_token - experts - dense_mlp)
        return rest, 2.0 * tokens * experts

    def moe_layer_weight_grad_flops(self, tokens: int) -> float:
        """FLOPs of one MoE layer's weight gradients (the dense layer's with the MLP replaced by
        the router, the top-k experts and the shared experts)."""
        dense_mlp = self._mlp_params(self.ffn_hidden_size)[0]
        return self.layer_weight_grad_flops(tokens) + 2.0 * tokens * (
            self._moe_block()[1] - dense_mlp)

    def _mlp_held(self, ffn: int, tp: int, recompute: str) -> float:
        """Bytes per token one MLP of FFN size ``ffn`` keeps for backward beyond its input
        (bf16): the activation's input (fc1's output) and fc2's input, split by TP; selective
        recompute keeps only the activation's input, full recompute nothing."""
        fc1 = 2 * ffn if self.swiglu else ffn
        if recompute == "none":
            return (2 * fc1 + 2 * ffn) / tp
        return 2 * fc1 / tp if recompute == "selective" else 0.0

    def moe_layer_activation_bytes(self, tokens: int, tp: int, recompute: str) -> float:
        """Bytes one MoE layer keeps for backward per micro-batch (the dense layer's count with
        its MLP replaced): each token's ``k`` copies at the experts (their inputs, bf16, and what
        each expert MLP keeps), the router's fp32 scores and the shared experts' MLP."""
        dense = self.layer_activation_bytes(tokens, tp, recompute)  # type: ignore[arg-type]
        if recompute == "full":
            return dense
        k, h = self.moe_router_topk, self.hidden_size
        mine = k * (2 * h + self._mlp_held(self.moe_ffn_hidden_size, tp, recompute))
        mine += 4 * self.num_experts  # router scores, fp32
        if self.moe_shared_expert_intermediate_size:
            mine += self._mlp_held(self.moe_shared_expert_intermediate_size, tp, recompute)
        return dense + tokens * (mine - self._mlp_held(self.ffn_hidden_size, tp, recompute))

    def moe_layer_weight_grad_bytes(self, tokens: int, tp: int) -> float:
        """The zero-bubble count of :meth:`ModelCounts.layer_weight_grad_bytes` for a MoE layer:
        the dense MLP's matrices' inputs and output gradients replaced by the top-k experts'
        (per routed copy) and the shared experts'."""
        h = self.hidden_size

        def mlp(ffn: int) -> float:  # fc1: h in, fc1 / t out; fc2: f / t in, h out
            fc1 = 2 * ffn if self.swiglu else ffn
            return 4 * h + (2 * fc1 + 2 * ffn) / tp

        mine = self.moe_router_topk * mlp(self.moe_ffn_hidden_size) + 2 * h  # + router input
        if self.moe_shared_expert_intermediate_size:
            mine += mlp(self.moe_shared_expert_intermediate_size)
        return self.layer_weight_grad_bytes(tokens, tp) + tokens * (
            mine - mlp(self.ffn_hidden_size))

    def moe_dispatch_bytes(self, tokens: int) -> float:
        """Bytes one all-to-all of a MoE layer moves for ``tokens`` tokens: each token's hidden
        state (bf16) to each of its ``k`` experts (dispatch; the combine moves as many back)."""
        return 2.0 * tokens * self.moe_router_topk * self.hidden_size

    # ------------------------------------------------------------------ checks
    def _fill_moe_defaults(self) -> None:
        if self.num_experts == 0:
            self.num_experts = None  # Megatron: 0 means no MoE
        if self.is_moe and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron: negative means no capacity

    def _check_moe(self) -> None:
        """Megatron's rules for the MoE flags, each a one-line error naming the flag."""
        if not self.is_moe:
            for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                         "moe_expert_capacity_factor"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{name.replace('_', '-')} needs --num-experts (a "
                                      "mixture-of-experts model)")
            return
        e, k = self.num_experts, self.moe_router_topk
        if e < 0:
            raise ConfigError(f"--num-experts must be positive, got {e}")
        if not 1 <= k <= e:
            raise ConfigError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
        self._check_layer_freq()
        self._check_router()
        factor = self.moe_expert_capacity_factor
        if factor == 0:
            raise ConfigError("--moe-expert-capacity-factor 0 would drop every token; give a "
                              "positive factor (or omit it to drop none)")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ConfigError("--moe-shared-expert-gate needs "
                              "--moe-shared-expert-intermediate-size")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                              "--moe-expert-capacity-factor")
        if self.moe_router_bias_update_rate < 0:
            raise ConfigError("--moe-router-bias-update-rate must be >= 0")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if (getattr(self, name) or 0.0) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")

    def _check_layer_freq(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            if len(freq) != self.num_layers:
                raise ConfigError(f"--moe-layer-freq lists {len(freq)} layers but --num-layers is "
                                  f"{self.num_layers}; give one 0 or 1 per layer")
        elif freq <= 0:
            raise ConfigError(f"--moe-layer-freq must be a positive integer, got {freq}")

    def _check_router(self) -> None:
        kind = self.moe_router_load_balancing_type
        if kind in _UNIMPLEMENTED_BALANCING:
            raise ConfigError(f"--moe-router-load-balancing-type {kind} is not implemented; use "
                              "aux_loss, seq_aux_loss or none")
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ConfigError("--moe-router-topk 1 with the softmax score function needs "
                              "--moe-router-pre-softmax (a softmax over one logit has no "
                              "gradient), as in Megatron")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                              "sigmoid or sqrtsoftplus")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if group_topk is None:
            return
        if not groups:
            raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups")
        if self.num_experts % groups:
            raise ConfigError(f"--moe-router-num-groups {groups} must divide --num-experts "
                              f"{self.num_experts}")
        if not 1 <= group_topk <= groups:
            raise ConfigError(f"--moe-router-group-topk {group_topk} must be between 1 and "
                              f"--moe-router-num-groups {groups}")
        if self.moe_router_topk > group_topk * (self.num_experts // groups):
            raise ConfigError(f"--moe-router-topk {self.moe_router_topk} exceeds the experts of "
                              f"the {group_topk} selected groups; raise --moe-router-group-topk")

    def describe_moe(self) -> str:
        """One phrase such as ``8 experts (top-2, softmax) in 4 of 4 layers``; empty when
        dense."""
        if not self.is_moe:
            return ""
        text = (f"{self.num_experts} experts (top-{self.moe_router_topk}, "
                f"{self.moe_router_score_function}) in {len(self.moe_layers)} of "
                f"{self.num_layers} layers")
        if self.moe_shared_expert_intermediate_size:
            text += f", shared experts of {self.moe_shared_expert_intermediate_size}"
        return text
