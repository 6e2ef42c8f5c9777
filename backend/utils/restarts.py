"""How a child process ended, in words, and how many restarts a supervisor may spend: shared by
the launcher (the whole server, the OpenAI front) and each replica's engine process."""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field


def exit_description(code: int | None) -> str:
    """A process's return code in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    """The wait before the second restart within the window; it doubles for each one after
    (the first waits nothing: a single crash heals at once)."""
    max_backoff_s: float = 30.0
    _times: deque = field(default_factory=deque, repr=False)

    def take(self, now: float) -> bool:
        """Spend one restart at `now`; False when the budget is used up."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def delay(self) -> float:
        """How long to wait before the restart just taken: 0, then backoff_s, doubling."""
        recent = len(self._times)
        return 0.0 if recent <= 1 else min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 2))

    @property
    def recent(self) -> int:
        """Restarts taken within the window as of the last `take`."""
        return len(self._times)
