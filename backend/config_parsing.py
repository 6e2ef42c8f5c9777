"""Building the config dataclasses (config.py, server_config.py) from config.pbtxt's string
values, and the checks their fields share."""

from __future__ import annotations

import dataclasses
from typing import Any


class _FromStrings:
    """Building a config dataclass from config.pbtxt's string values, converting by field type."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_names(cls, names) -> None:
        """Raise ValueError for names that are not fields (typos in config.pbtxt or --param)."""
        known = cls.field_names()
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"unknown parameter(s) of {cls.__name__} {unknown}; known: {sorted(known)}")

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> Any:
        """Build from string values (Triton `parameters`), converting by field type.

        Unknown names are an error so that a typo in config.pbtxt is not silently ignored.
        """
        cls.check_names(values)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            kwargs[name] = _convert(name, str(types[name]), raw)
        return cls(**kwargs)


def _convert(name: str, type_name: str, raw: str) -> Any:
    raw = raw.strip()
    optional = "None" in type_name
    if optional and raw.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            # "float | str": a number, or a word the field's own check accepts (kv_cache_memory_gb=auto)
            return float(raw) if "str" not in type_name or _is_number(raw) else raw
        if type_name.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise ValueError(f"engine parameter {name!r}: cannot parse {raw!r} as {type_name}") from None
    return raw


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value < float("inf")):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")

