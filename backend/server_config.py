"""ServerConfig: how a served replica admits, paces and answers requests, and how it keeps its
engine process (config.py re-exports it; config.pbtxt's parameters map onto its fields)."""

from __future__ import annotations

from dataclasses import dataclass

from splitfuse.config_parsing import _FromStrings, _check_non_negative, _check_positive


@dataclass
class ServerConfig(_FromStrings):
    """How a served replica admits, paces and answers requests (the engine itself does not read
    these): the `llm` model's and EngineLoop's settings, beside EngineConfig in config.pbtxt."""

    default_temperature: float = 0.0
    """Temperature of server requests that send no `temperature` input: 0 = greedy, as
    TensorRT-LLM's ensemble is when no sampling inputs are sent. (`SamplingParams` built in
    Python carry their own temperature.)"""
    max_waiting_requests: int = 512
    """Requests a server replica holds that are not running (queued for their first step, or
    preempted); past it a new request is refused at once ("server busy": Triton UNAVAILABLE,
    the OpenAI front's 429) instead of queueing without bound. 0 = no bound."""
    max_queue_time_s: float = 0.0
    """A served request not started within this many seconds of its arrival ends with a
    "server busy" error (UNAVAILABLE / 429), so clients retry elsewhere instead of waiting
    behind a backlog. 0 = no deadline."""
    report_num_cached_tokens: bool = False
    """Served requests may ask for `num_cached_tokens` (prompt tokens found in the prefix cache)
    without a `cache_salt`. Off by default: the count tells a client whether another client sent
    the same prompt prefix recently. A request with a cache_salt may always ask (its cache hits
    can only come from requests with the same salt)."""
    stream_interval: int = 4
    """A streaming request's new tokens go to its caller every this many tokens (its first token
    and its end at once; a token waits at most stream_interval_max_ms). Each Triton response is a
    round trip to the server process (~1 ms on 2 busy cores): larger values send fewer responses
    per token under load, the tokens arriving in groups. 1 sends every step's tokens. The default
    4 served 9-22% more requests per second than 1 at 16-128 clients, and the best effective
    throughput (perf/results/2026-11-27-served-stream-interval-*)."""
    stream_interval_max_ms: float = 50.0
    """The longest a token waits for stream_interval's group: it goes out with the first step
    that ends this many milliseconds after it was made, however few tokens are held then (under
    light load groups fill quickly; under heavy load, where steps are slow, this caps the added
    latency). 0 = no bound."""
    replica_balance_max_wait_ms: float = 200.0
    """With several replicas (instance_group count > 1), one holding more requests than the least
    loaded of the others waits up to this long before it takes another, so Triton gives new
    requests to the others (it would otherwise hand them to whichever replica takes them first:
    one held 30+ while the other ran dry, perf/results s35). The least loaded never waits.
    0 = off."""
    numa_nodes: str = ""
    """The NUMA node of each replica by instance index, comma-separated ("0,1": the first on
    node 0, the second on node 1): its threads pinned to the node's CPUs (num_threads, when 0,
    one per physical core there) and its memory bound there. The launcher's `--instances auto`
    sets it on a machine with several nodes. Empty: not placed."""

    engine_process: bool = True
    """The replica's engine (scheduler, KV cache, model, kernels) runs in a child process of its
    Triton stub: an engine fault (a kernel's crash, the OOM killer, a hung step) then ends that
    replica's requests and restarts its engine, while the other replicas serve on
    (docs/engine_process.md). false = in the stub's process, where any such fault is a stub death
    and the launcher restarts the whole server."""
    step_timeout_s: float = 60.0
    """engine_process: an engine that makes no step for this long while it holds work hangs; it
    is killed and restarted. Well under the launcher's --step-timeout (300 s), which restarts the
    whole server."""
    engine_restarts: int = 5
    """engine_process: restarts of a replica's engine allowed within engine_restart_window_s; one
    more fault and the replica fails for good (the model unloads, as for a broken engine)."""
    engine_restart_window_s: float = 600.0
    """See engine_restarts."""
    engine_memory_limit_bytes: int = 0
    """engine_process: the engine process's address space (RLIMIT_AS), so that a runaway engine
    fails alone instead of waking the OOM killer. 0 = no limit."""

    def numa_node_list(self) -> list[int]:
        return [int(n) for n in self.numa_nodes.split(",")] if self.numa_nodes.strip() else []

    def __post_init__(self) -> None:
        if self.numa_nodes.strip() and not all(n.strip().isdigit() for n in self.numa_nodes.split(",")):
            raise ValueError(f"numa_nodes must be node numbers separated by commas, got {self.numa_nodes!r}")
        _check_non_negative("default_temperature", self.default_temperature)
        if not (isinstance(self.max_waiting_requests, int) and not isinstance(self.max_waiting_requests, bool)
                and self.max_waiting_requests >= 0):
            raise ValueError(f"max_waiting_requests must be an integer >= 0, got {self.max_waiting_requests!r}")
        _check_non_negative("max_queue_time_s", self.max_queue_time_s)
        _check_positive("stream_interval", self.stream_interval)
        _check_non_negative("stream_interval_max_ms", self.stream_interval_max_ms)
        _check_non_negative("replica_balance_max_wait_ms", self.replica_balance_max_wait_ms)
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        _check_non_negative("engine_restarts", self.engine_restarts)
        _check_non_negative("engine_restart_window_s", self.engine_restart_window_s)
        _check_non_negative("engine_memory_limit_bytes", self.engine_memory_limit_bytes)
