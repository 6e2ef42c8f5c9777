"""What the LoRA adapters are doing, for metrics: a plain record (no torch), which crosses from an
engine process to its Triton stub."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraStats:
    """What the adapters are doing, for metrics."""

    configured: list[str]
    resident: list[str]
    """Adapters whose weights are in memory, least recently used first."""
    loads: int
    """Times an adapter's weights were read into memory (at start and after evictions)."""
    evictions: int
    requests: dict[str, int] = field(default_factory=dict)
    """Requests accepted per adapter."""
