"""Reading and writing plan files: the YAML form of a :class:`~megatron_h2.plan.schema.HeteroPlan`.

:func:`plan_from_dict` turns the YAML-shaped mapping into a plan (one-line errors naming the
file, the pipeline and the stage), :func:`plan_to_dict` is its inverse, and :func:`write_plan`
writes a plan with one flow-style line per stage and the planner's prediction as comments. The
schema itself is described in :mod:`megatron_h2.plan.schema`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import yaml

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, LinkSpec, StageSpec
from megatron_h2.plan.yaml_io import check_keys, positive_int

_SHARED_KEYS = ("micro_batch_size", "global_batch_size", "chips")
_ONE_PIPELINE_KEYS = ("data_parallel_size", *_SHARED_KEYS, "stages")
_OPTIONAL_KEYS = ("schedule", "transports")
_PIPELINE_KEYS = ("batch_share", "stages")
_PIPELINE_OPTIONAL_KEYS = ("data_parallel_size", "schedule")
_CHIP_KEYS = ("device", "emulate_slowdown")
_STAGE_KEYS = ("chip", "tensor_parallel_size", "num_layers", "recompute", "data_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size")
_LINK_KEYS = ("chips", "transport")


def _chips(raw: Any, source: str) -> dict[str, ChipSpec]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"'chips' in {source} must map chip names to {{device: ...}}")
    chips = {}
    for name, chip in raw.items():
        entry = check_keys(chip, _CHIP_KEYS[:1], _CHIP_KEYS[1:], f"chip '{name}' of {source}")
        chips[str(name)] = ChipSpec(**dict(entry))
    return chips


def _stages(raw: Any, where: str) -> list[StageSpec]:
    """The stage list of one pipeline; ``where`` names it (``plan 'x'``, ``pipeline 1 of ...``)."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"'stages' in {where} must be a non-empty list of stages")
    stages = []
    for index, stage in enumerate(raw):
        at = f"stage {index} of {where}"
        entry = dict(check_keys(stage, _STAGE_KEYS[:3], _STAGE_KEYS[3:], at))
        layers = entry["num_layers"]
        if isinstance(layers, list):  # one count per model chunk
            if not layers:
                raise ConfigError(f"{at}: num_layers is an empty list; give one layer count per "
                                  "model chunk")
            entry["chunk_layers"] = tuple(layers)
            entry["num_layers"] = sum(n for n in layers if isinstance(n, int))
        try:
            stages.append(StageSpec(**entry))
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
    return stages


def _links(raw: Any, source: str) -> list[LinkSpec]:
    if not isinstance(raw, list):
        raise ConfigError(f"'transports' in {source} must be a list of "
                          "{chips: [a, b], transport: ...}")
    links = []
    for index, link in enumerate(raw):
        entry = check_keys(link, _LINK_KEYS, (), f"transports entry {index} of {source}")
        links.append(LinkSpec(**dict(entry)))
    return links


def _check_share(share: Any, stages: list[StageSpec], dp: int, micro_batch: int,
                 where: str) -> int:
    """A pipeline's batch share: whole micro-batches for every replica of every stage."""
    positive_int(share, f"batch_share of {where}")
    if share % micro_batch:
        raise ConfigError(f"{where}: batch_share {share} is not a whole number of micro-batches "
                          f"of {micro_batch} sequences; make it a multiple of {micro_batch}")
    for index, stage in enumerate(stages):
        own = dp if stage.data_parallel_size is None else stage.data_parallel_size
        if share % (micro_batch * own):
            raise ConfigError(f"{where}: batch_share {share} does not split into whole "
                              f"micro-batches over stage {index}'s {own} data-parallel replicas; "
                              f"make it a multiple of micro_batch_size x DP = {micro_batch * own}")
    return share


def _pipeline(raw: Any, index: int, top: Mapping[str, Any], chips: dict[str, ChipSpec],
              links: list[LinkSpec], source: str) -> HeteroPlan:
    """Pipeline ``index`` of a plan's ``pipelines`` list, as a plan of one pipeline whose
    global_batch_size is its share."""
    where = f"pipeline {index} of {source}"
    entry = check_keys(raw, _PIPELINE_KEYS, _PIPELINE_OPTIONAL_KEYS, where)
    stages = _stages(entry["stages"], where)
    dp = entry.get("data_parallel_size", top.get("data_parallel_size", 1))
    positive_int(dp, f"data_parallel_size of {where}")
    share = _check_share(entry["batch_share"], stages, dp, top["micro_batch_size"], where)
    try:
        return HeteroPlan(data_parallel_size=dp, micro_batch_size=top["micro_batch_size"],
                          global_batch_size=share, chips=chips, stages=stages,
                          schedule=entry.get("schedule", top.get("schedule")), transports=links)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def plan_from_dict(data: Any, source: str = "plan") -> HeteroPlan:
    """Build a plan from the YAML-shaped mapping; ``source`` names it in error messages."""
    several = isinstance(data, Mapping) and "pipelines" in data
    if several:
        if "stages" in data:
            raise ConfigError(f"{source} lists both 'stages' and 'pipelines'; a plan of several "
                              "pipelines gives the stages of each in its pipelines entry")
        top = check_keys(data, (*_SHARED_KEYS, "pipelines"),
                         ("data_parallel_size", *_OPTIONAL_KEYS), source)
    else:
        top = check_keys(data, _ONE_PIPELINE_KEYS, (*_OPTIONAL_KEYS, "pipelines"), source)
    chips = _chips(top["chips"], source)
    links = _links(top.get("transports", []), source)
    if not several:
        return HeteroPlan(data_parallel_size=top["data_parallel_size"],
                          micro_batch_size=top["micro_batch_size"],
                          global_batch_size=top["global_batch_size"], chips=chips,
                          stages=_stages(top["stages"], source), schedule=top.get("schedule"),
                          transports=links)
    positive_int(top["micro_batch_size"], "micro_batch_size")
    raw = top["pipelines"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"'pipelines' in {source} must be a non-empty list of pipelines "
                          "({batch_share: ..., stages: [...]})")
    pipelines = [_pipeline(entry, index, top, chips, links, source)
                 for index, entry in enumerate(raw)]
    if len(pipelines) == 1:  # one pipeline: the plan is that pipeline
        only = pipelines[0]
        if only.global_batch_size != top["global_batch_size"]:
            raise ConfigError(f"the only pipeline of {source} has batch_share "
                              f"{only.global_batch_size} but global_batch_size is "
                              f"{top['global_batch_size']}; make them equal")
        return only
    return HeteroPlan(data_parallel_size=top.get("data_parallel_size", 1),
                      micro_batch_size=top["micro_batch_size"],
                      global_batch_size=top["global_batch_size"], chips=chips, stages=(),
                      transports=links, pipelines=pipelines)


def _stage_dicts(plan: HeteroPlan) -> list[dict[str, Any]]:
    return [
        {
            "chip": s.chip,
            "tensor_parallel_size": s.tensor_parallel_size,
            "num_layers": list(s.chunk_layers) if s.chunk_layers else s.num_layers,
            "recompute": s.recompute,
            **({} if s.data_parallel_size is None
               else {"data_parallel_size": s.data_parallel_size}),
            **({} if s.expert_model_parallel_size == 1
               else {"expert_model_parallel_size": s.expert_model_parallel_size}),
            **({} if s.expert_tensor_parallel_size is None
               else {"expert_tensor_parallel_size": s.expert_tensor_parallel_size}),
        }
        for s in plan.stages
    ]


def _default_schedule(plan: HeteroPlan) -> str:
    return "interleaved" if plan.virtual_pipeline_size > 1 else "1f1b"


def plan_to_dict(plan: HeteroPlan) -> dict[str, Any]:
    """Plain YAML-ready mapping; ``emulate_slowdown`` is written only when it is not 1.0."""
    chips: dict[str, Any] = {}
    for name, chip in plan.chips.items():
        entry: dict[str, Any] = {"device": chip.device}
        if chip.emulate_slowdown != 1.0:
            entry["emulate_slowdown"] = chip.emulate_slowdown
        chips[name] = entry
    out: dict[str, Any] = {}
    if not plan.pipelines:
        out["data_parallel_size"] = plan.data_parallel_size
    out.update(micro_batch_size=plan.micro_batch_size,
               global_batch_size=plan.global_batch_size, chips=chips)
    if plan.pipelines:
        out["pipelines"] = []
        for pipe in plan.pipelines:
            entry = {"batch_share": pipe.global_batch_size,
                     "data_parallel_size": pipe.data_parallel_size,
                     "stages": _stage_dicts(pipe)}
            if pipe.schedule != _default_schedule(pipe):
                entry["schedule"] = pipe.schedule
            out["pipelines"].append(entry)
    else:
        out["stages"] = _stage_dicts(plan)
        if plan.schedule != _default_schedule(plan):
            out["schedule"] = plan.schedule
    if plan.transports:
        out["transports"] = [{"chips": list(link.chips), "transport": link.transport}
                             for link in plan.transports]
    return out


def _flow(value: Mapping[str, Any]) -> str:
    """One-line YAML flow mapping, e.g. ``{chip: fast, num_layers: 3}``."""
    text = yaml.safe_dump(dict(value), default_flow_style=True, sort_keys=False, width=10_000)
    return cast(str, text).strip()


def _stage_lines(stages: list[dict[str, Any]], indent: str) -> list[str]:
    return [f"{indent}- {_flow(stage)}" for stage in stages]


def write_plan(plan: HeteroPlan, path: str | Path, header: str | None = None) -> None:
    """Write ``plan``; ``header`` lines (e.g. the planner's prediction) become YAML comments."""
    data = plan_to_dict(plan)
    lines = [f"# {line}".rstrip() for line in (header or "").splitlines()]
    for key in ("data_parallel_size", "micro_batch_size", "global_batch_size"):
        if key in data:
            lines.append(f"{key}: {data[key]}")
    lines.append("chips:")
    for name, chip in data["chips"].items():
        key = _flow({name: 0})[1:-4]  # the name as YAML writes a key (quoted if needed)
        lines.append(f"  {key}: {_flow(chip)}")
    if "pipelines" in data:
        lines.append("pipelines:  # data-parallel pipelines, each computing the whole model")
        for pipe in data["pipelines"]:
            lines.append(f"  - batch_share: {pipe['batch_share']}")
            lines.append(f"    data_parallel_size: {pipe['data_parallel_size']}")
            if "schedule" in pipe:
                lines.append(f"    schedule: {pipe['schedule']}")
            lines.append("    stages:  # stage 0 holds the embedding, the last the head")
            lines += _stage_lines(pipe["stages"], "      ")
    else:
        lines.append("stages:  # pipeline order: stage 0 holds the embedding, the last the head")
        lines += _stage_lines(data["stages"], "  ")
        if "schedule" in data:
            lines.append(f"schedule: {data['schedule']}")
    if data.get("transports"):
        lines.append("transports:  # the bridge's transfer library per pair of chip types")
        for link in data["transports"]:
            lines.append(f"  - {_flow(link)}")
    Path(path).write_text("\n".join(lines) + "\n")
