"""The errors and error-message prefixes that cross layers (engine, its process, the servers):
one home, importable without torch (a served replica's Triton stub never loads it)."""

from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine's own resources are gone (e.g. a tensor-parallel rank died or hangs): no later
    step can succeed, so servers fail every request and report not ready instead of retrying."""


SERVER_BUSY = "server busy"
"""How every busy refusal's message starts: servers map it to UNAVAILABLE / HTTP 429."""


class ServerBusyError(RuntimeError):
    """A replica refuses a request for now (its waiting queue is full): retry later or elsewhere."""


class EngineFailedError(RuntimeError):
    """The engine is broken and serves no more requests (`EngineLoop.failure` says why)."""


class UnknownLoraError(LookupError):
    """An unload names an adapter the engine does not serve (a 404 to HTTP clients)."""


GUIDE_REFUSED = "guided_decoding_guide refused"
"""How the error of a request whose guide did not compile starts (servers: an invalid argument)."""

REPLICA_RETIRED = "this replica retired"
"""How a retired replica's refusals start (its engine failed for good while other replicas of the
model serve): UNAVAILABLE, and the OpenAI front retries the request once, on another replica."""

ENGINE_FAULT = "the replica's engine process failed"
"""How the error of a request ended by an engine process fault starts (servers: UNAVAILABLE)."""


ERROR_CODE_PARAMETER = "splitfuse_error_code"
"""A request parameter (bool) that asks the `llm` model to lead each error message with its
status, "[INVALID_ARGUMENT] ...". A gRPC stream's in-band errors carry no status; Triton's
`triton_grpc_error` header would end the stream with it, but Triton 2.51's handling of such an
ending races with its own done-notification and, once in a few hundred errors, crashes the
server (SIGSEGV in infer_handler.h). The OpenAI front asks for the code this way instead."""


def with_error_code(message: str, code_name: str) -> str:
    """`message` led by its status name (gRPC's spelling: INVALID_ARGUMENT, UNAVAILABLE, ...)."""
    return f"[{code_name}] {message}"


def split_error_code(message: str) -> tuple[str | None, str]:
    """(status name or None, the message without it): the inverse of with_error_code."""
    if message.startswith("["):
        name, sep, rest = message[1:].partition("] ")
        if sep and name and name.replace("_", "").isalpha() and name.isupper():
            return name, rest
    return None, message
