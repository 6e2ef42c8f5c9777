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
"""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from splitfuse.triton_server import control


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as dead: it holds no port, serves nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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
    _times: deque = field(default_factory=deque, repr=False)

    def take(self, now: float) -> bool:
        """Spend one restart at `now`; False when the budget is used up."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


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
