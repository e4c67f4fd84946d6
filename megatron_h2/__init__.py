"""megatron_h2: Megatron-style LLM pretraining across heterogeneous accelerator clusters.

Layers, lowest first. A module may import from its own package and from packages of a lower
layer, never from a higher one or a sibling of its layer (``tests/test_layers.py`` checks it):

0. ``errors`` <- ``config`` (typed run configuration and the one model description with its
   parameter, FLOP and memory counts) and ``yaml_checks`` (key, number and file checks of the
   YAML files users write) <- ``hetero_plan`` (the plan file) and ``pipeline_orders`` (each
   stage's order of forwards and backwards under every pipeline schedule, shared by the
   runtime and the planner's simulator): plain Python, no torch.
1. ``devices`` (DiTorch: one interface over each vendor's torch backend), ``data`` (indexed
   datasets, tokenizers, corpora) and ``planner`` (HeteroAuto: cost model, search, simulator;
   never torch).
2. ``distributed`` (DiComm: rank topology and process groups, pipeline point-to-point traffic,
   the cross-vendor bridge, data-parallel gradient buckets).
3. ``parallel`` (tensor / sequence parallel layers and loss) and ``pipeline`` (HeteroPP
   schedules).
4. ``optimizer`` (AdamW, the data-parallel and ZeRO-1 optimizers, the learning-rate schedule).
5. ``models`` (the GPT model, built per pipeline stage).
6. ``checkpointing`` (the checkpoint format, distributed save / load, Hugging Face conversion).
7. ``training`` (command line, launch layout, step, loop, metrics).
"""

__version__ = "0.1.0"

LAYERS: dict[str, int] = {
    "errors": 0, "config": 1, "yaml_checks": 1, "hetero_plan": 2, "pipeline_orders": 2,
    "devices": 3, "data": 3, "planner": 3,
    "distributed": 4,
    "parallel": 5, "pipeline": 5,
    "optimizer": 6,
    "models": 7,
    "checkpointing": 8,
    "training": 9,
}
"""Layer of each top-level module / package (see above)."""
