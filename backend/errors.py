"""Errors after which the engine cannot serve any more (as opposed to one failed step), and the
refusal of a server that is too busy to take a request now."""

from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine's own resources are gone (e.g. a tensor-parallel rank died or hangs): no later
    step can succeed, so servers fail every request and report not ready instead of retrying."""


SERVER_BUSY = "server busy"
"""How every busy refusal's message starts: servers map it to UNAVAILABLE / HTTP 429."""


class ServerBusyError(RuntimeError):
    """A replica refuses a request for now (its waiting queue is full): retry later or elsewhere."""
