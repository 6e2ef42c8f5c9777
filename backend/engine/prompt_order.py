"""The order in which the scheduler computes prompts.

- arrival: first come, first served.
- deadline: earliest first-token deadline first, a prompt's first token being due at its arrival
  plus its length at `first_token_deadline_tokens_per_s` (DeepSpeed-FastGen's SLA uses 512): a
  short prompt that arrives among long ones does not wait for all of them, and a long one is
  passed only by prompts due before it (a deadline is fixed at arrival).
- goodput: deadline order, except that a prompt which can no longer make its deadline at the
  engine's measured prompt rate goes after those that still can (Moore-Hodgson's rule: when the
  prompts in deadline order would make one late, the one with the most tokens left goes last),
  so as many requests as possible get their first token in time. A deferred prompt returns to
  deadline order once its wait reaches twice its deadline's allowance, so none starves.

Each order ranks the prompts of one request priority (SamplingParams.priority): the scheduler puts
higher priorities first, and the goodput rule reckons finishing times in that order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from splitfuse.config import PROMPT_ORDERS
from splitfuse.engine.sequence import Sequence

# Weight of the newest step in the engine's measured tokens per second.
RATE_SMOOTHING = 0.25


class PromptOrder:
    def __init__(self, order: str, deadline_tokens_per_s: float, token_budget: int) -> None:
        if order not in PROMPT_ORDERS:
            raise ValueError(f"prompt_order must be one of {PROMPT_ORDERS}, got {order!r}")
        self.order = order
        self.by_deadline = order != "arrival"
        self.deadline_tokens_per_s = deadline_tokens_per_s
        self.token_budget = token_budget
        self.tokens_per_s: float | None = None
        """Tokens the engine computes a second, measured over its steps."""
        self._deferred: set[int] = set()  # ids of prompts that go after every other (goodput)

    def deadline(self, seq: Sequence) -> float:
        """When `seq`'s first token is due (time.monotonic() seconds)."""
        return seq.arrival_time + seq.num_prompt_tokens / self.deadline_tokens_per_s

    def priority(self, seq: Sequence) -> tuple[bool, float, int]:
        """Sort key of prompts (deadline and goodput orders): deferred ones last, then earliest
        deadline, equal deadlines in arrival order."""
        return id(seq) in self._deferred, self.deadline(seq), seq.arrival

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` in `seconds`. Only steps of at least half the budget
        count: a light step's fixed costs would understate the rate."""
        if 2 * num_tokens >= self.token_budget and seconds > 0:
            rate = num_tokens / seconds
            self.tokens_per_s = rate if self.tokens_per_s is None else (
                RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * self.tokens_per_s)

    def defer_hopeless(self, prompts: Iterable[Sequence], now: float, prompt_tokens_per_s: float,
                       step_s: float = 0.0) -> bool:
        """Choose the prompts to defer (goodput) when the engine computes `prompt_tokens_per_s`
        prompt tokens a second in steps of `step_s` seconds (a prompt's first token comes at the end
        of the step that computes its last chunk: up to a step after the rate alone says); True
        when the choice changed (the queue must be re-sorted)."""
        deferred: set[int] = set()
        if prompt_tokens_per_s > 0:
            finish = now + step_s  # when the first token of the last prompt kept so far would come
            kept: list[tuple[int, int, int]] = []  # max-heap by tokens left: (-tokens, arrival, id)
            # In the order they run: by request priority, then deadline.
            for seq in sorted(prompts, key=lambda s: (-s.params.priority, self.deadline(s), s.arrival)):
                due = self.deadline(seq)
                tokens = seq.num_uncomputed_tokens
                protected = now - seq.arrival_time >= 2 * (due - seq.arrival_time)
                if not protected and now + step_s + tokens / prompt_tokens_per_s > due:
                    deferred.add(id(seq))  # late even if it ran first
                    continue
                finish += tokens / prompt_tokens_per_s
                if not protected:
                    heapq.heappush(kept, (-tokens, seq.arrival, id(seq)))
                if finish > due and kept:
                    most, _, victim = heapq.heappop(kept)
                    deferred.add(victim)
                    finish -= -most / prompt_tokens_per_s
        changed = deferred != self._deferred
        self._deferred = deferred
        return changed
