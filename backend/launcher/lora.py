"""LoRA adapters on the command line: `--lora NAME=PATH` (repeatable) -> the `lora_modules`
engine parameter, each folder made absolute and checked before anything starts.

Absolute, because tritonserver and the OpenAI front run in other directories; checked here,
because a folder that is missing would otherwise surface as a model that failed to load, deep
in Triton's log.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from splitfuse.config import EngineConfig

LORA_MODULES = "lora_modules"
# What makes a folder a PEFT adapter (the engine reads and checks the rest at start).
ADAPTER_CONFIG = "adapter_config.json"


def lora_flag_value(items: list[str]) -> str:
    """`--lora` items ['a=dir', ...] -> a `lora_modules` value ("a=/abs/dir,..."); ValueError
    naming the bad item."""
    pairs = []
    for item in items:
        name, sep, path = (s.strip() for s in item.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"--lora expects NAME=PATH (a PEFT adapter folder), got {item!r}")
        pairs.append((name, path))
    return format_lora_modules(resolve_adapters(pairs, "--lora"))


def resolve_lora_modules(value: str) -> dict[str, str]:
    """A `lora_modules` value parsed by the engine's own rules, each folder absolute and checked."""
    # The engine's parser (names, duplicates, name=path form); the model is not looked at.
    adapters = EngineConfig(model=".", lora_modules=value).lora_adapters()
    return resolve_adapters(list(adapters.items()), LORA_MODULES)


def resolve_adapters(pairs: list[tuple[str, str]], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, path in pairs:
        if name in out:
            raise ValueError(f"{what}: adapter name {name!r} is given twice")
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            raise ValueError(f"{what}: LoRA adapter {name!r}: folder {path} does not exist")
        if not (folder / ADAPTER_CONFIG).is_file():
            raise ValueError(f"{what}: LoRA adapter {name!r}: {folder} has no {ADAPTER_CONFIG} (not a PEFT adapter "
                             "folder)")
        if "," in str(folder) or "=" in str(folder):  # lora_modules' separators
            raise ValueError(f"{what}: LoRA adapter {name!r}: the folder's path {folder} contains ',' or '=', "
                             "which lora_modules cannot hold: move or link it elsewhere")
        out[name] = str(folder)
    return out


def format_lora_modules(adapters: Mapping[str, str]) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def lora_params(params: Mapping[str, str], items: list[str]) -> dict[str, str]:
    """The engine parameters with `--lora` items as their `lora_modules` (not both ways at once),
    its folders absolute and checked."""
    out = dict(params)
    given = out.get(LORA_MODULES, "").strip()
    if items and given:
        raise ValueError("give LoRA adapters either with --lora or with --param lora_modules=..., not both")
    if items:
        out[LORA_MODULES] = lora_flag_value(items)
    elif given:
        out[LORA_MODULES] = format_lora_modules(resolve_lora_modules(given))
    return out
