"""Process faults of a running server: the watchdog that finds them, and the restart budget.

What Triton 2.51 does with a dead Python-backend stub decides the cure. Tried here: `kill -9` of
one `llm` stub of two under streaming load made tritonserver itself abort (a boost interprocess
lock_exception: the stub died holding a shared-memory mutex), every stream of both replicas
ending with UNAVAILABLE; earlier runs saw the server survive with the model still READY, the
dead stub's requests never answered and later ones failing "Stub process is not healthy". The
Python backend restarts no stub of a decoupled model, and reloading the model waits for requests
that a dead stub will never release. So the launcher treats any replica fault (a stub gone, a
replica stopped or hung, tritonserver gone) the same way: it kills the whole server, which ends
every request still in flight with an error, and starts it again on the same ports, within a
restart budget; past the budget it exits non-zero for an orchestrator to restart the pod.

The OpenAI front is a child of its own (FrontWatch): when it exits it is started again, after a
back-off that grows with its recent restarts, within a budget of its own; past that budget the
launcher exits non-zero too. The health port's /ready says 503 from its exit until it answers.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from splitfuse.triton_server import control
from splitfuse.utils.restarts import RestartBudget, exit_description


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as dead: it holds no port, serves nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Child(Protocol):
    """What FrontWatch needs of the process it keeps (OpenAIFront)."""

    def running(self) -> bool: ...

    def returncode(self) -> int | None: ...

    def restart(self) -> None: ...

    def answers(self) -> bool: ...

    def kill(self) -> None: ...


@dataclass
class FrontWatch:
    """Keeps the OpenAI front running: `poll` (every launcher loop turn) finds it gone, spends a
    restart of `budget`, waits its back-off, starts it again, and says it is `up` once it
    answers HTTP again; a restart that does not answer within `start_timeout_s` is killed."""

    front: Child
    budget: RestartBudget
    start_timeout_s: float = 120.0
    """A restarted front that does not answer within this is killed (and counts as one more exit)."""
    up: bool = False
    """The front answers: the health port's /ready needs it."""
    restarts: int = 0
    _restart_at: float | None = field(default=None, repr=False)
    _starting: float | None = field(default=None, repr=False)
    """When the restart under way began."""

    def started(self) -> None:
        """The launcher saw the first start answer: the front is up."""
        self.up = True

    def poll(self, now: float | None = None) -> str | None:
        """One look; why the launcher must give up (the budget is spent), else None."""
        now = time.monotonic() if now is None else now
        if self._starting is not None:
            if self.front.running() and now - self._starting > self.start_timeout_s:
                _say(f"the restarted OpenAI front did not answer within {self.start_timeout_s:g}s: killing it")
                self.front.kill()
            if self.front.running():
                if self.front.answers():
                    self._starting, self.up = None, True
                    _say(f"the OpenAI front serves again (restart {self.restarts})")
                return None
            self._starting = None  # died (or was killed) while starting: one more exit, below
        if self._restart_at is None:
            if self.front.running():
                return None
            self.up = False
            how = exit_description(self.front.returncode())
            if not self.budget.take(now):
                return (f"the OpenAI front exited ({how}); {self.restarts} restarts already within "
                        f"{self.budget.window_s:g}s (--max-restarts {self.budget.max_restarts}): giving up")
            wait = self.budget.delay()
            self._restart_at = now + wait
            _say(f"the OpenAI front exited ({how}); restarting it" + (f" in {wait:g}s" if wait else ""))
        if now >= self._restart_at:
            self._restart_at = None
            self.restarts += 1
            self.front.restart()
            self._starting = now
        return None


def _say(message: str) -> None:
    print(f"splitfuse.launcher: {message}", file=sys.stderr, flush=True)


@dataclass
class Watchdog:
    """Finds a dead or hung replica of the server whose control folder is `control_dir`, from
    the heartbeats its `llm` instances write every half second (control.Control.beat)."""

    control_dir: Path
    step_timeout_s: float = 300.0
    """A replica whose engine made no step for this long while holding requests hangs; one
    whose heartbeat is this old stopped (SIGSTOP, a frozen process)."""
    _progress: dict[str, tuple[int, float]] = field(default_factory=dict, repr=False)
    _last: dict[str, control.Heartbeat] = field(default_factory=dict, repr=False)

    def reset(self) -> None:
        self._progress.clear()
        self._last.clear()

    def in_flight(self) -> int:
        """Requests the replicas held at their last heartbeats."""
        return sum(beat.pending for beat in self._last.values())

    def fault(self, server_pid: int, now_wall: float | None = None, now: float | None = None) -> str | None:
        """Why a replica of the tritonserver `server_pid` cannot serve, or None while all can."""
        now_wall = time.time() if now_wall is None else now_wall
        now = time.monotonic() if now is None else now
        beats = control.read_heartbeats(self.control_dir)
        self._last.update({name: beat for name, beat in beats.items() if beat.ppid == server_pid})
        for name, beat in sorted(self._last.items()):
            if not alive(beat.pid):
                return f"replica {name} (pid {beat.pid}) died"
            age = now_wall - beat.wall
            if age > self.step_timeout_s:
                return f"replica {name} (pid {beat.pid}) stopped: no heartbeat for {age:.0f} s"
            steps, since = self._progress.get(name, (-1, now))
            if beat.steps != steps or beat.pending == 0:
                self._progress[name] = (beat.steps, now)
            elif now - since > self.step_timeout_s:
                return (f"replica {name} (pid {beat.pid}) hangs: no engine step for {now - since:.0f} s with "
                        f"{beat.pending} requests in flight (step_timeout_s={self.step_timeout_s:g})")
        return None
