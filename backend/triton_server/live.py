"""One request the `llm` model holds in its engine: where its responses go, what it asked for,
and whether it was cancelled or has ended."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from splitfuse.triton_server.request import Parsed


@dataclass
class Live:
    """A request in the engine: where its responses go and what it asked for."""

    engine_id: str
    stop_handle: str
    """What a stop request must send to stop this generation (given to its client only)."""
    sender: Any
    parsed: Parsed
    arrival: float
    """time.perf_counter() at arrival, for latencies."""
    last_token: float | None = None
    cancelled: bool = False
    echo_pending: bool = False
    handle_pending: bool = False
    error_code: bool = False
    """Its error responses lead with their status (errors.ERROR_CODE_PARAMETER)."""
    error: str | None = None
    """Its response could not be built: the final response carries this error."""
    done: bool = False
    """The final response went out. Guarded by `lock`: after the final flag Triton frees the
    response factory, and is_cancelled() on it then crashes the whole server (2.51)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
