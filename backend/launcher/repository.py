"""Rendering the model repository: the template with the checkpoint, the engine parameters
(checked against EngineConfig and ServerConfig before anything starts) and the instance counts filled in."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from splitfuse.config import check_parameter_names, split_parameters
from splitfuse.utils.cpu_budget import available_cpus
from splitfuse.launcher.lora import LORA_MODULES, format_lora_modules, resolve_lora_modules
from splitfuse.models.gguf_checkpoint import prepare_checkpoint

# Template repository: $SPLITFUSE_MODEL_REPOSITORY, else the copy an installed (non-editable)
# package carries as package data (splitfuse/model_repository), else the source tree's
# `model_repository/`.
TEMPLATE_ENV = "SPLITFUSE_MODEL_REPOSITORY"
LLM_MODEL = "llm"
PREPROCESSING_MODEL = "preprocessing"
PLACEHOLDER_PREFIX = "${"
# Triton model names are directory names: keep a prefix to what every file system and URL takes.
PREFIX_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def default_template_dir() -> Path:
    env = os.environ.get(TEMPLATE_ENV)
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parents[1] / "model_repository"
    if (packaged / LLM_MODEL / "config.pbtxt").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "model_repository"


def parse_params(items: list[str] | None) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}, checking names against EngineConfig and ServerConfig."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--param expects NAME=VALUE, got {item!r}")
        out[name] = value
    check_parameter_names(out)
    return out


def render_model_repository(
    out_dir: str | os.PathLike,
    model: str | os.PathLike,
    params: Mapping[str, str] | None = None,
    instances: int = 1,
    preprocessing_instances: int = 1,
    template_dir: str | os.PathLike | None = None,
    name_prefix: str = "",
) -> Path:
    """Copy the template's models into `out_dir` with the checkpoint and engine parameters set.

    `params` are EngineConfig and ServerConfig fields (string values, as in config.pbtxt); they
    are validated here by building both, so a typo fails before the server starts. `name_prefix`
    goes before every model's name (`<prefix>llm`, `<prefix>preprocessing`, `<prefix>ensemble`,
    the ensemble's steps renamed with them), so several LLMs, or ours beside other models,
    share one repository. Only our models' folders in `out_dir` are replaced; anything else
    there stays.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    template = Path(template_dir) if template_dir is not None else default_template_dir()
    if not (template / LLM_MODEL / "config.pbtxt").is_file():
        raise FileNotFoundError(f"no model repository template at {template} (set {TEMPLATE_ENV})")
    if instances < 1 or preprocessing_instances < 1:
        raise ValueError("instance counts must be >= 1")
    if not set(name_prefix) <= PREFIX_CHARACTERS or name_prefix.startswith("."):
        raise ValueError(f"model name prefix {name_prefix!r}: use letters, digits, '-', '_' and '.' (not first)")
    model_path, params = _resolved(model, params)
    out = Path(out_dir)
    ours = _copy_models(template, out, name_prefix)

    def edit(name: str, fn) -> None:
        path = out / (name_prefix + name) / "config.pbtxt"
        cfg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        cfg.name = name_prefix + name
        for step in cfg.ensemble_scheduling.step:  # the ensemble's steps are our models too
            step.model_name = name_prefix + step.model_name
        fn(cfg)
        path.write_text(text_format.MessageToString(cfg))

    def edit_llm(cfg) -> None:
        for key, value in params.items():
            cfg.parameters[key].string_value = str(value)
        placed = cfg.parameters["numa_nodes"].string_value.strip() if "numa_nodes" in cfg.parameters else ""
        if placed and len(placed.split(",")) != instances:
            raise ValueError(f"numa_nodes={placed!r} names {len(placed.split(','))} node(s) for {instances} llm "
                             "instance(s): give one node per instance")
        if instances > 1 and not placed and cfg.parameters["num_threads"].string_value in ("", "0"):
            # Replicas share the machine: each engine's OpenMP team gets its share of the cores
            # (N replicas of one thread per core would oversubscribe every core N times). Replicas
            # placed on NUMA nodes take their node's cores instead (numa_placement.py).
            cfg.parameters["num_threads"].string_value = str(replica_threads(instances))
        if "kv_cache_replicas" not in params:  # kv_cache_memory_gb=auto divides the memory among them
            cfg.parameters["kv_cache_replicas"].string_value = str(instances)
        values = {k: v.string_value for k, v in cfg.parameters.items()}
        _check_filled(LLM_MODEL, values)
        split_parameters(values)  # raises ValueError naming the bad field
        _set_instances(cfg, instances)

    def edit_pre(cfg) -> None:
        cfg.parameters["tokenizer"].string_value = params.get("tokenizer") or str(model_path)
        # An upper bound of the engine's max_model_len (which the KV pool may lower further).
        context = params.get("max_model_len") or json.loads((model_path / "config.json").read_text()).get(
            "max_position_embeddings", "")
        cfg.parameters["max_input_tokens"].string_value = str(context)
        _check_filled(PREPROCESSING_MODEL, {k: v.string_value for k, v in cfg.parameters.items()})
        _set_instances(cfg, preprocessing_instances)

    for name in ours:
        edit(name, {LLM_MODEL: edit_llm, PREPROCESSING_MODEL: edit_pre}.get(name, lambda cfg: None))
    return out


def _resolved(model: str | os.PathLike, params: Mapping[str, str] | None) -> tuple[Path, dict[str, str]]:
    """The checkpoint directory and the parameters with every path made absolute (the server
    runs elsewhere), names checked against EngineConfig and ServerConfig."""
    model_path = Path(prepare_checkpoint(model)).resolve()
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{model_path} is not a Hugging Face checkpoint directory (no config.json)")
    params = dict(params or {})
    check_parameter_names(params)
    params["model"] = str(model_path)
    if params.get("tokenizer"):
        params["tokenizer"] = str(Path(prepare_checkpoint(params["tokenizer"])).resolve())
    if params.get(LORA_MODULES, "").strip():
        params[LORA_MODULES] = format_lora_modules(resolve_lora_modules(params[LORA_MODULES]))
    return model_path, params


def _copy_models(template: Path, out: Path, name_prefix: str) -> list[str]:
    """Copy the template's models into `out` under their prefixed names (replacing only those);
    returns their template names."""
    out.mkdir(parents=True, exist_ok=True)
    ours = [d.name for d in sorted(template.iterdir()) if (d / "config.pbtxt").is_file()]
    for name in ours:
        target = out / (name_prefix + name)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(template / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # Empty version directories (the ensemble's) are not kept by git but Triton needs them.
        if not any(p.name.isdigit() for p in target.iterdir()):
            (target / "1").mkdir()
    return ours


def replica_threads(instances: int) -> int:
    """`num_threads` of each of `instances` engine replicas when none is given: the CPUs this
    process may use (cpu_budget.available_cpus), shared evenly."""
    return max(1, available_cpus() // instances)


def _check_filled(model: str, values: Mapping[str, str]) -> None:
    left = sorted(k for k, v in values.items() if v.startswith(PLACEHOLDER_PREFIX))
    if left:
        raise ValueError(f"{model}: parameter(s) {left} still hold template placeholders")


def _set_instances(cfg, count: int) -> None:
    if not cfg.instance_group:
        cfg.instance_group.add()
    for group in cfg.instance_group:
        group.count = count
