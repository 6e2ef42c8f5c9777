"""Per-request state: sampling parameters, the sequence being generated, its outputs."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from splitfuse.structured.guide import Guide


# Temperatures below this sample as greedy: dividing logits by a smaller one overflows them to
# infinity (and would pick token 0, not the most likely one).
MIN_TEMPERATURE = 1e-5
# Bounds that keep one request's cost reasonable for the others (every stop string is matched
# against each new token's text).
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's range for the presence and frequency penalties, on every path.
MAX_PENALTY = 2.0
MAX_CACHE_SALT_LENGTH = 256
# Above 2 a penalty only wrecks the text (HF/vLLM set no ceiling; common values are 1.0-1.5), and
# a huge one turns every seen token's logit to +-inf.
MAX_REPETITION_PENALTY = 2.0
# OpenAI's bound on top_logprobs: every alternative is a row of the response per output token.
MAX_TOP_LOGPROBS = 20
# Request priorities lie in [-MAX_PRIORITY, MAX_PRIORITY]: room for many classes, and a bound
# that keeps a value from another system's convention (or a typo) from being taken silently.
MAX_PRIORITY = 1000

TopLogprobs = list[tuple[int, float]]
"""One output token's most likely alternatives: (token id, log-prob), most likely first."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy (so does anything below MIN_TEMPERATURE)."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    """HF-style: divides positive / multiplies negative logits of tokens seen in prompt or output."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Same seed and prompt give the same tokens whatever else is in the batch."""
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the decoded text; the match is not part of the output."""
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    """Return the log-probability of each chosen token (under the model's raw distribution)."""
    top_logprobs: int = 0
    """Return, for each output token, this many most likely tokens (0..MAX_TOP_LOGPROBS) with
    their log-probabilities, under the distribution `logprobs` uses (the model's raw one, after
    a guide's mask: tokens the grammar disallows have -inf). Independent of `logprobs`."""
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    """Keys the prefix cache (vLLM's name): a request reuses cached KV only from requests with
    the same salt, so tenants that keep theirs secret cannot probe each other's prompts."""
    guide: Guide | None = None
    """Constrains the output to a JSON schema, any JSON, a regex, an EBNF grammar or a choice
    (splitfuse.structured): every token sampled is one the grammar allows, and the output ends
    when the grammar is complete."""
    lora_name: str | None = None
    """The LoRA adapter (EngineConfig.lora_modules) to generate with; None: the base model."""
    priority: int = 0
    """Scheduling class, in [-MAX_PRIORITY, MAX_PRIORITY]: HIGHER is served first (vLLM's is the
    other way round). Waiting prompts are admitted by priority, then in the prompt order; under KV
    pressure the lowest-priority running sequence is preempted first. It never changes what is
    sampled."""
    embed: bool = False
    """Return the prompt's embedding instead of generating: the final hidden states (after the
    final norm) pooled as the engine's EngineConfig.embedding_pooling says, L2-normalised, in the
    final output (RequestOutput.embedding). The prompt is computed (chunked, batched, prefix-cached
    like any other) and the request ends after its last chunk with no token sampled."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("top_logprobs", self.top_logprobs, minimum=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                             f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                             f"characters, got {len(self.stop)} (longest {max(map(len, self.stop))})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise ValueError(f"guide must be a splitfuse.structured.guide.Guide, got {type(self.guide).__name__}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with a guide (the grammar decides where the output ends)")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LENGTH
        ):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LENGTH} characters")
        _check_int("priority", self.priority, minimum=None)
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority}")
        if not isinstance(self.embed, bool):
            raise ValueError(f"embed must be true or false, got {self.embed!r}")
        if self.embed and self.guide is not None:
            raise ValueError("embed cannot be combined with a guide (an embedding generates no tokens)")
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(f"lora_name must be a non-empty string or None, got {self.lora_name!r}")


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # this request failed inside the engine (RequestOutput.error says why)


@dataclass(eq=False)
class Sequence:
    """One request's tokens and where its KV lives.

    `token_ids` is prompt + output. `num_computed_tokens` of them have KV in the cache;
    the rest are computed in later steps (one for a decode, many for a prompt or a
    sequence recomputed after preemption). Only the step that computes the last token
    samples the next one.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per output token, its params.top_logprobs alternatives (empty when not asked for)."""
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache when first scheduled (None before)."""
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    """Chained hashes of the leading full blocks of `token_ids` (memo of the BlockManager)."""
    arrival_time: float = field(default_factory=time.monotonic)
    """time.monotonic() when the request arrived (a server stamps it when it takes the request)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Tokens proposed to follow `token_ids` (speculative decoding), verified by the next step
    that decodes this sequence; empty when nothing is proposed."""
    rope_offset: int = 0
    """Where this sequence's rows start in the model's rope tables, for its whole life: LongRoPE's
    long factors for a prompt past the switch (layers.rope_tables); part of its prefix-cache key."""
    pooling: str | None = None
    """"last" or "mean" for an embedding request (SamplingParams.embed; the engine's
    embedding_pooling), None for a generation. A "mean" one keeps every row's final hidden state."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: float | None = None,
                     top_logprobs: TopLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)


@dataclass
class RequestOutput:
    """What one step produced for one request, and everything so far.

    `token_ids`, `text`, `logprobs` and `top_logprobs` (everything so far) are read from the
    request's growing state, cut at this step's length, when asked for: a step costs the new
    tokens, not a copy of the whole output (a stream reads only the deltas).
    """

    request_id: str
    prompt_token_ids: list[int]
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[TopLogprobs] | None = None
    """Per new token, its most likely alternatives (SamplingParams.top_logprobs > 0)."""
    # Snapshot of the request's state: lists and text only ever grow, so lengths suffice.
    seq_token_ids: list[int] = field(default_factory=list, repr=False)
    num_tokens: int = 0
    seq_logprobs: list[float] | None = field(default=None, repr=False)
    seq_top_logprobs: list[TopLogprobs] | None = field(default=None, repr=False)
    text_source: Any = field(default=None, repr=False)  # has a `.text` str (the detokenizer)
    text_len: int = 0
    error: str | None = None
    """Why the request failed (finish_reason "error"); None otherwise."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV was found in the prefix cache instead of being computed."""
    embedding: Any = None
    """The prompt's pooled, normalised embedding (numpy float32 [hidden]) in the final output of
    a request with SamplingParams.embed; None otherwise."""

    @property
    def token_ids(self) -> list[int]:
        """All output tokens up to this step."""
        return self.seq_token_ids[len(self.prompt_token_ids) : self.num_tokens]

    @property
    def text(self) -> str:
        """All output text up to this step (stop strings removed)."""
        return self.text_source.text[: self.text_len] if self.text_source is not None else ""

    @property
    def logprobs(self) -> list[float] | None:
        """Log-prob of each output token up to this step, when asked for."""
        if self.seq_logprobs is None:
            return None
        return self.seq_logprobs[: self.num_tokens - len(self.prompt_token_ids)]

    @property
    def top_logprobs(self) -> list[TopLogprobs] | None:
        """Most likely alternatives of each output token up to this step, when asked for."""
        if self.seq_top_logprobs is None:
            return None
        return self.seq_top_logprobs[: self.num_tokens - len(self.prompt_token_ids)]

    @property
    def is_first(self) -> bool:
        """Whether the deltas hold every output token so far (nothing was delivered before)."""
        return self.num_tokens - len(self.prompt_token_ids) == len(self.delta_token_ids)

    def after(self, earlier: RequestOutput) -> RequestOutput:
        """This output with an earlier, undelivered one's deltas in front of its own."""
        return replace(self, delta_token_ids=earlier.delta_token_ids + self.delta_token_ids,
                       delta_text=earlier.delta_text + self.delta_text,
                       delta_logprobs=_joined(earlier.delta_logprobs, self.delta_logprobs),
                       delta_top_logprobs=_joined(earlier.delta_top_logprobs, self.delta_top_logprobs))


def _joined(earlier: list | None, later: list | None) -> list | None:
    """Two outputs' per-token deltas in order. A later None (not asked for, or no tokens, as in
    the final output of an abort) must not drop what the earlier one carries."""
    if earlier is None and later is None:
        return None
    return (earlier or []) + (later or [])
