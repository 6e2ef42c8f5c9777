"""What crosses the pipe between a replica's stub and its engine process (remote.py, core_process.py).

Every message is a tuple led by its tag, pickled by multiprocessing.connection. Outputs cross as
compact records of a step's deltas, never a request's growing token list: the stub keeps each
request's tokens and text so far (`Stream`) and rebuilds the `RequestOutput` its callbacks take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from splitfuse.engine.sequence import RequestOutput

# stub -> engine
SUBMIT = "submit"  # (SUBMIT, call id, request id, prompt, SamplingParams)
ABORT = "abort"  # (ABORT, request id)
LORA = "lora"  # (LORA, call id, "load" or "unload", adapter name, folder or None): answered by a REPLY
SHUTDOWN = "shutdown"  # (SHUTDOWN, seconds the in-flight requests get): aborts them, then ends
# engine -> stub
HELLO = "hello"  # (HELLO, EngineFacts): the engine is built and serving
START_FAILED = "start_failed"  # (START_FAILED, "Class: message"): building it raised
REPLY = "reply"  # (REPLY, call id, error class name or None, message, whether a guide compiles)
GRAMMAR = "grammar"  # (GRAMMAR, request id): its guide's compile ended (either way)
BATCH = "batch"  # (BATCH, Progress): outputs and step statistics since the last batch
FAILED = "failed"  # (FAILED, reason, resources lost): the engine is broken (EngineLoop.failure, .resources_lost)
LOG = "log"  # (LOG, logger name, level, text): a record of the engine's loggers, for the stub's log

LORA_TIMEOUT_S = 300.0
"""Longest a run-time LoRA load or unload waits for the engine thread (reading happens before)."""


@dataclass(frozen=True)
class EngineFacts:
    """What the stub reads of the engine it no longer holds, sent once at start."""

    pid: int
    tokenizer: str
    """The tokenizer's directory as the engine loaded it (a GGUF file's converted checkpoint)."""
    lora_names: tuple[str, ...]
    max_model_len: int
    runner_line: str
    """The runner's backends, weights and threads, for the stub's start-up log line."""
    threads: int = 1
    """The engine's compute threads (torch's, in the process that runs it)."""
    prompt_max_chars: int = 0
    """The most characters a text prompt may have (inputs.PromptLimit: the context times the
    tokenizer's longest token), which bounds the stub's text_input tensor."""


@dataclass
class Progress:
    """One batch from the engine process: its outputs (records) and where the engine stands."""

    records: list[tuple] = field(default_factory=list)
    steps: list = field(default_factory=list)
    """StepStats of each step since the last batch (the stub's on_step)."""
    step_count: int = 0
    num_waiting: int = 0
    busy: bool = False
    """The engine holds work (requests waiting, running or compiling): no step for long is a hang."""
    stats: object = None
    lora_stats: object = None


def to_record(out: RequestOutput, first: bool) -> tuple:
    """One output's deltas; the prompt's ids on a request's first record, the whole text on its
    final one (stop strings may cut text the deltas already carried); an embedding request's
    vector (float32 numpy, pickled as its bytes) on its final one."""
    return (out.request_id, out.delta_token_ids, out.delta_text, out.finished, out.finish_reason, out.error,
            out.delta_logprobs, out.delta_top_logprobs, out.num_cached_tokens,
            out.prompt_token_ids if first else None, out.text if out.finished else None, out.embedding)


class Stream:
    """The stub's copy of one request's output so far, grown by its records."""

    __slots__ = ("prompt", "token_ids", "text", "logprobs", "top_logprobs")

    def __init__(self) -> None:
        self.prompt: list[int] = []
        self.token_ids: list[int] = []  # the prompt's, then the output's
        self.text = ""
        self.logprobs: list[float] | None = None
        self.top_logprobs: list | None = None

    def apply(self, record: tuple) -> RequestOutput:
        (request_id, delta_ids, delta_text, finished, reason, error, delta_logprobs, delta_top, cached,
         prompt_ids, final_text, embedding) = record
        if prompt_ids is not None:
            self.prompt = prompt_ids
            self.token_ids = list(prompt_ids)
        self.token_ids.extend(delta_ids)  # lists only grow: an output is its lengths (RequestOutput)
        self.text = final_text if final_text is not None else self.text + delta_text
        if delta_logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(delta_logprobs)
        if delta_top is not None:
            self.top_logprobs = self.top_logprobs if self.top_logprobs is not None else []
            self.top_logprobs.extend(delta_top)
        return RequestOutput(
            request_id=request_id, prompt_token_ids=self.prompt, delta_token_ids=delta_ids,
            delta_text=delta_text, finished=finished, finish_reason=reason, delta_logprobs=delta_logprobs,
            delta_top_logprobs=delta_top, seq_token_ids=self.token_ids, num_tokens=len(self.token_ids),
            seq_logprobs=self.logprobs, seq_top_logprobs=self.top_logprobs, text_source=self,
            text_len=len(self.text), error=error, num_cached_tokens=cached, embedding=embedding)

    def end(self, request_id: str, finish: str, error: str | None) -> RequestOutput:
        """The last output of a request whose engine is gone."""
        return self.apply((request_id, [], "", True, finish, error, None, None, 0, None, self.text, None))


def log_record(message: tuple) -> None:
    """A LOG message of the engine process's loggers, logged in this process under the same logger
    (so the stub's handlers, Triton's log among them, take it as one of their own)."""
    _, name, level, text = message
    logging.getLogger(name).log(level, "%s", text)


def receive(conn) -> tuple | None:
    """The next message from `conn` (a multiprocessing Connection); None once its peer is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def engine_facts(engine) -> EngineFacts:
    """The facts of an engine built in this process (an LLMEngine)."""
    import os

    import torch

    runner = engine.runner
    line = (f"device={runner.device} dtype={str(runner.dtype).removeprefix('torch.')} "
            f"attention_backend={runner.attention_backend} linear_backend={runner.linear_backend} "
            f"quantization={runner.quantization} weights={runner.weight_memory_summary()} "
            f"threads={torch.get_num_threads()} decoder layers in {runner.decoder_layers}")
    return EngineFacts(pid=os.getpid(), tokenizer=engine.config.tokenizer, lora_names=tuple(engine.lora_names()),
                       max_model_len=engine.max_model_len, runner_line=line, threads=torch.get_num_threads(),
                       prompt_max_chars=engine.validator.prompt_limit.max_chars)
