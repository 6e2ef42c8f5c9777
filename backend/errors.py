"""Errors after which the engine cannot serve any more (as opposed to one failed step)."""

from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine's own resources are gone (e.g. a tensor-parallel rank died or hangs): no later
    step can succeed, so servers fail every request and report not ready instead of retrying."""
