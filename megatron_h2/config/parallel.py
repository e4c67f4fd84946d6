"""Tensor / pipeline / data parallelism, virtual stages, heterogeneous plans and the bridge."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.config.flags import _positive, flag, layer_split
from megatron_h2.errors import ConfigError


@dataclass
class ParallelConfig:
    """Uniform tensor / pipeline / data parallelism (Megatron's flags). DP is what remains of the
    world size after TP x PP. A heterogeneous plan file replaces the TP / PP fields."""

    tensor_model_parallel_size: int = flag(1, "Degree of tensor model parallelism.")
    pipeline_model_parallel_size: int = flag(1, "Degree of pipeline model parallelism.")
    # one layer count per stage ([3, 1]), or per model chunk one list with a count per stage
    # ([[2, 1], [1, 2]] for --pipeline-layer-split 2,1/1,2: chunk 0 = 2 + 1, chunk 1 = 1 + 2)
    pipeline_layer_split: list[int] | list[list[int]] | None = flag(
        None, "Layers per pipeline stage, e.g. 3,1 (embedding on the first stage, head and loss "
        "on the last); with virtual stages per model chunk, chunks separated by '/': 2,1/1,2 = "
        "chunk 0 of stages 0 and 1 (2 and 1 layers), then chunk 1 (1 and 2), the layers in model "
        "order.", parse=layer_split, metavar="SPLIT")
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "Transformer layers on the first pipeline stage (the rest spread evenly).")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "Transformer layers on the last pipeline stage (the rest spread evenly).")
    sequence_parallel: bool = flag(False, "Enable sequence parallel optimization.")
    expert_model_parallel_size: int = flag(
        1, "Degree of expert model parallelism: each of the EP ranks of a stage holds 1/EP of "
        "every MoE layer's experts and tokens travel to them (--moe-token-dispatcher-type); "
        "carved from the stage's TP x DP ranks as Megatron-Core does (EP groups span DP "
        "replicas; under --sequence-parallel each MoE block gathers its TP group's sequence).")
    expert_tensor_parallel_size: int | None = flag(
        None, "Degree of tensor model parallelism of the experts (default, as Megatron's: the "
        "stage's TP): each expert's linear_fc1 is split by columns and linear_fc2 by rows over "
        "ETP ranks; where it differs from TP each TP rank dispatches its 1/TP of the tokens, "
        "the routed rows are all-gathered over the expert-TP group and the outputs "
        "reduce-scattered back, as in Megatron-Core.")
    use_distributed_optimizer: bool = flag(
        False, "Use the distributed optimizer (optimizer state sharded over data-parallel ranks, "
        "ZeRO-1).")
    distributed_timeout_minutes: float = flag(10.0, "Timeout minutes for torch.distributed.")
    heartbeat_timeout: float = flag(
        30.0, "Seconds without a heartbeat after which a rank counts as stopped (killed, "
        "SIGSTOPped, a hung host): it is named in one line and the job ends, instead of waiting "
        "for --distributed-timeout-minutes; 0 turns the heartbeat off.")
    ddp_bucket_size: int | None = flag(
        None, "Bucket size (elements) for data-parallel communication; default: "
        "max(40000000, 1000000 x data-parallel size).")
    overlap_grad_reduce: bool = flag(
        False, "Overlap the data-parallel gradient reduction with the last backward.")
    overlap_param_gather: bool = flag(
        False, "Overlap the distributed optimizer's all-gather of updated parameters with the "
        "next forward: issued after the step, each bucket waited for just before the forward "
        "first uses its parameters (needs --use-distributed-optimizer and "
        "--overlap-grad-reduce).")
    hetero_plan: str | None = flag(
        None, "YAML plan (tools/plan.py writes one): pipeline stages on chip types, each with its "
        "own TP, layers and recompute.")
    force_bridge: bool = flag(
        False, "Route every stage boundary through the host-staged cross-vendor bridge.")
    bridge_dtype: str = flag("fp32", "Precision of activations and gradients crossing the bridge.",
                             choices=("fp32", "bf16"))
    bridge_chunk_mb: float = flag(4.0, "Chunk size (MiB) of bridge transfers.")
    # Virtual pipeline stages (Megatron's interleaving): model chunks per stage, or layers per
    # chunk (V = layers / PP / N); at most one of the two.
    virtual_pipeline_model_parallel_size: int | None = flag(
        None, "Model chunks per pipeline stage (Megatron's interleaved schedule).",
        aliases=("--num-virtual-stages-per-pipeline-rank",))
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "Layers per model chunk: virtual pipeline size = layers / PP / N.")
    pipeline_schedule: str | None = flag(
        None, "1f1b, interleaved or zero-bubble (which splits the backward and defers weight "
        "gradients into the bubble); default: interleaved with virtual stages, else 1f1b.",
        choices=("1f1b", "interleaved", "zero-bubble"))

    context_parallel_size: int = flag(
        1, "Degree of context parallelism; only 1: context parallelism is not implemented (split "
        "long sequences with TP and --sequence-parallel instead).")

    def bucket_size_mb(self, data_parallel_size: int) -> float:
        """The gradient bucket size in MiB of fp32 gradients (Megatron's default when unset)."""
        elements = self.ddp_bucket_size or max(40_000_000, 1_000_000 * data_parallel_size)
        return elements * 4 / 2**20

    def __post_init__(self) -> None:
        if self.context_parallel_size != 1:
            raise ConfigError(f"--context-parallel-size {self.context_parallel_size}: context "
                              "parallelism is not implemented; use 1 (split long sequences with "
                              "TP and --sequence-parallel instead)")
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "distributed_timeout_minutes", "bridge_chunk_mb")
        if not 0 <= self.heartbeat_timeout <= 86400:
            raise ConfigError(f"--heartbeat-timeout must be in [0, 86400] seconds (0: off), got "
                              f"{self.heartbeat_timeout:g}")
        if self.heartbeat_timeout >= 60 * self.distributed_timeout_minutes:
            raise ConfigError(f"--heartbeat-timeout {self.heartbeat_timeout:g} s must be shorter "
                              f"than --distributed-timeout-minutes "
                              f"{self.distributed_timeout_minutes:g} (the collectives would time "
                              "out first); lower it")
        if self.ddp_bucket_size is not None:
            _positive(self, "ddp_bucket_size")
        self._check_experts()
        if self.overlap_param_gather and not (self.use_distributed_optimizer
                                              and self.overlap_grad_reduce):
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                              "--overlap-grad-reduce (as in Megatron)")
        if self.bridge_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--bridge-dtype must be fp32 or bf16, got {self.bridge_dtype!r}")
        if self.pipeline_layer_split is not None:
            self._check_split()
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        self._check_virtual()

    def _check_experts(self) -> None:
        _positive(self, "expert_model_parallel_size")
        if self.expert_tensor_parallel_size is not None:
            _positive(self, "expert_tensor_parallel_size")

    @property
    def _per_chunk_split(self) -> list[list[int]] | None:
        split = self.pipeline_layer_split
        if split and isinstance(split[0], (list, tuple)):
            return [list(chunk) for chunk in split]
        return None

    def _check_split(self) -> None:
        pp = self.pipeline_model_parallel_size
        chunks = self._per_chunk_split or [self.pipeline_layer_split]
        for c, counts in enumerate(chunks):
            if len(counts) != pp:
                where = f" in chunk {c}" if len(chunks) > 1 else ""
                raise ConfigError(
                    f"--pipeline-layer-split has {len(counts)} counts{where} but "
                    f"--pipeline-model-parallel-size is {pp}; give one layer count per stage "
                    "(stages separated by ',', model chunks by '/')")
            if any(n < 0 for n in counts):
                raise ConfigError("--pipeline-layer-split counts must be >= 0")
        if (self.decoder_first_pipeline_num_layers is not None
                or self.decoder_last_pipeline_num_layers is not None):
            raise ConfigError("use either --pipeline-layer-split or --decoder-first/last-"
                              "pipeline-num-layers, not both")

    def _check_virtual(self) -> None:
        v, n = self.virtual_pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        for name, value in (("virtual_pipeline_model_parallel_size", v),
                            ("num_layers_per_virtual_pipeline_stage", n)):
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, "
                                  f"got {value}")
        if v is not None and n is not None:
            raise ConfigError("give either --virtual-pipeline-model-parallel-size or "
                              "--num-layers-per-virtual-pipeline-stage, not both")
        if n is not None and (self.pipeline_layer_split is not None
                              or self.decoder_first_pipeline_num_layers is not None
                              or self.decoder_last_pipeline_num_layers is not None):
            raise ConfigError("--num-layers-per-virtual-pipeline-stage splits the layers evenly; "
                              "for an uneven split use --pipeline-layer-split with per-chunk "
                              "counts (e.g. 2,1/1,2) instead")
        split = self._per_chunk_split
        if split is not None and v is not None and v != len(split):
            raise ConfigError(f"--pipeline-layer-split gives {len(split)} model chunks but "
                              f"--virtual-pipeline-model-parallel-size is {v}")
        if self.pipeline_schedule not in (None, "1f1b", "interleaved", "zero-bubble"):
            raise ConfigError(f"--pipeline-schedule must be 1f1b, interleaved or zero-bubble, "
                              f"got {self.pipeline_schedule!r}")

    def chunk_layers(self, num_layers: int) -> list[list[int]]:
        """``[stage][chunk]``: layers of every model chunk of every stage (one chunk per stage
        without virtual stages); counts that do not add up are an error."""
        pp, split = self.pipeline_model_parallel_size, self._per_chunk_split
        if split is not None:
            total = sum(map(sum, split))
            if total != num_layers:
                text = "/".join(",".join(map(str, chunk)) for chunk in split)
                raise ConfigError(f"--pipeline-layer-split {text} adds up to {total} layers but "
                                  f"--num-layers is {num_layers}")
            return [[chunk[s] for chunk in split] for s in range(pp)]
        n = self.num_layers_per_virtual_pipeline_stage
        if n is not None:
            if num_layers % pp:
                raise ConfigError(f"--num-layers-per-virtual-pipeline-stage needs --num-layers "
                                  f"{num_layers} divisible by --pipeline-model-parallel-size {pp}")
            if (num_layers // pp) % n:
                raise ConfigError(f"the {num_layers // pp} layers of each pipeline stage are not "
                                  f"divisible by --num-layers-per-virtual-pipeline-stage {n}")
            return [[n] * (num_layers // pp // n) for _ in range(pp)]
        v = self.virtual_pipeline_model_parallel_size or 1
        counts = self.stage_layers(num_layers)
        for stage, count in enumerate(counts):
            if count % v:
                raise ConfigError(
                    f"stage {stage} has {count} layers, which do not split into "
                    f"--virtual-pipeline-model-parallel-size {v} equal chunks; give per-chunk "
                    "counts with --pipeline-layer-split (e.g. 2,1/1,2)")
        return [[count // v] * v for count in counts]

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layer count of every pipeline stage; counts that do not add up are an error."""
        pp = self.pipeline_model_parallel_size
        if self._per_chunk_split is not None:
            return [sum(chunks) for chunks in self.chunk_layers(num_layers)]
        if self.pipeline_layer_split is not None:
            split = list(self.pipeline_layer_split)
            if sum(split) != num_layers:
                raise ConfigError(f"--pipeline-layer-split {','.join(map(str, split))} adds up "
                                  f"to {sum(split)} layers but --num-layers is {num_layers}")
            return split
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if pp == 1:
            if first not in (None, num_layers) or last not in (None, num_layers):
                raise ConfigError("--decoder-first/last-pipeline-num-layers need "
                                  "--pipeline-model-parallel-size > 1")
            return [num_layers]
        fixed = [first, *([None] * (pp - 2)), last]
        rest = num_layers - sum(n for n in fixed if n is not None)
        free = sum(n is None for n in fixed)
        if rest < 0 or (free and rest % free) or (not free and rest):
            raise ConfigError(
                f"{num_layers} layers cannot be split over {pp} stages with first={first} and "
                f"last={last}: the remaining {rest} must divide evenly over {free} stage(s); "
                "use --pipeline-layer-split for an explicit split")
        return [n if n is not None else rest // free for n in fixed]
