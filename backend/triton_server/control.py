"""The file board shared by the `llm` model's instances and the launcher (splitfuse.launcher).

Each `llm` instance is its own stub process, so a stop request may land on an instance other
than the one running the generation, and the launcher must tell every instance to drain
before Triton shuts down. Files under one directory carry both.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The launcher puts the board's directory in the stubs' environment under this name.
ENV = "SPLITFUSE_CONTROL_DIR"
DRAIN, ABORT, IDLE = "drain", "abort", "idle"
LIMITS = "limits.json"
HEARTBEAT = "heartbeat"
FAULTS = "faults.json"


# ---- launcher side ------------------------------------------------------------------------
def request_drain(base: Path) -> None:
    """Instances refuse new requests from now on."""
    (base / DRAIN).touch()


def draining_requested(base: Path) -> bool:
    return (base / DRAIN).exists()


def request_abort(base: Path) -> None:
    """Instances refuse new requests and abort every generation in flight."""
    (base / DRAIN).touch()
    (base / ABORT).touch()


def num_idle(base: Path) -> int:
    """Instances that are draining with nothing in flight."""
    idle = base / IDLE
    return len(os.listdir(idle)) if idle.is_dir() else 0


@dataclass
class Heartbeat:
    """What an instance last said of itself (Control.beat): the launcher's watchdog reads it."""

    instance: str
    pid: int
    ppid: int
    """Its tritonserver: a beat of another server's process (an orphan) is not this server's."""
    steps: int
    """Engine steps taken so far: stuck while `pending` > 0 means the engine hangs."""
    pending: int
    """Requests in flight in the instance."""
    wall: float
    """time.time() when written: old means the whole process stopped (SIGSTOP, a freeze)."""
    engine_pid: int | None = None
    """The instance's engine process (engine_process), None while it has none (restarting)."""


def read_heartbeats(base: Path) -> dict[str, Heartbeat]:
    """The latest heartbeat of each instance that wrote one, by instance name."""
    out = {}
    folder = base / HEARTBEAT
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            beat = Heartbeat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # replaced while read, or a file of another version
        out[beat.instance] = beat
    return out


def write_faults(base: Path, **faults: float) -> None:
    """The launcher's fault record (restarts, requests failed by faults, last recovery time),
    for a restarted server's instances to publish as metrics."""
    _write_json(base / FAULTS, faults)


def read_faults(base: Path) -> dict:
    try:
        return json.loads((base / FAULTS).read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # readers never see half a file


def read_limits(base: Path, model_name: str) -> dict:
    """What the model's instances published of their engine's limits (Control.publish_limits),
    e.g. the max_model_len the KV cache allows; {} until one has."""
    try:
        return json.loads((base / model_name / LIMITS).read_text())
    except (OSError, ValueError):
        return {}


def private_dir(path: Path) -> Path:
    """`path` created (or found) as a directory of this user's only (mode 0700, not a link);
    RuntimeError when someone else's is in the way."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"the control folder {path} exists but is not a private directory of this user; "
                           f"remove it, or set {ENV} to a directory of your own")
    return path


# ---- instance side ------------------------------------------------------------------------
class Control:
    """Files shared by the instances of this model and by the launcher (splitfuse.launcher).

        <dir>/<model>/stop/<tag>/<key>  explicit stops for the instance whose tag leads the
                                  stop handle: a stop request lands on any instance, but the
                                  generation may live in another (each instance is a process);
                                  the owner applies each file once and deletes it
        <dir>/drain               launcher: refuse new requests, the server is shutting down
        <dir>/abort               launcher: abort every generation in flight
        <dir>/idle/<instance>     this instance: draining, and nothing is in flight
        <dir>/<model>/load/<instance>  this instance: requests it holds, for the others to
                                  share new ones evenly (replica_balance.py)
        <dir>/<model>/limits.json the engine's limits, for the launcher to pass on (the
                                  instances share one config, so they write the same)
        <dir>/heartbeat/<instance>.json  this instance: its pid, engine steps and requests in
                                  flight, rewritten every half second (the launcher's watchdog)
        <dir>/faults.json         launcher: restarts and what they cost, for the metrics

    The launcher exists because Triton 2.51 cannot unload a decoupled Python model that had
    a request in flight when shutdown began; it stops generations before sending SIGTERM.
    """

    def __init__(self, model_name: str, instance: str) -> None:
        env = os.environ.get(ENV)
        # Without the launcher: a directory scoped to this server (the stubs' parent process).
        # Its name is predictable, so it must be ours alone: another local user who created it
        # first could otherwise read and post stops for our requests.
        self.base = Path(env) if env else private_dir(Path(tempfile.gettempdir()) / f"splitfuse-{os.getppid()}")
        self.owned = not env
        self.model_dir = self.base / model_name
        """This model's part of the board (its instances' other shared files live under it)."""
        self.stop_dir = self.model_dir / "stop"
        self.tag = self.key(instance)[:12]
        """Leads this instance's stop handles, so a stop landing elsewhere finds its owner."""
        self.own_stops = self.stop_dir / self.tag
        self.own_stops.mkdir(parents=True, exist_ok=True)
        self.idle_file = self.base / IDLE / instance
        self.instance = instance
        self._idle = False

    def draining(self) -> bool:
        return draining_requested(self.base)

    def aborting(self) -> bool:
        return (self.base / ABORT).exists()

    def set_idle(self, idle: bool) -> None:
        if idle == self._idle:
            return
        self._idle = idle
        if idle:
            self.idle_file.parent.mkdir(parents=True, exist_ok=True)
            self.idle_file.touch()
        else:
            self.idle_file.unlink(missing_ok=True)

    @staticmethod
    def key(client_id: str) -> str:
        # A digest: request ids may be long or hold characters a file name cannot.
        return hashlib.sha256(client_id.encode("utf-8")).hexdigest()[:32]

    def publish_limits(self, **limits: int) -> None:
        _write_json(self.model_dir / LIMITS, limits)

    def beat(self, steps: int, pending: int, engine_pid: int | None = None) -> None:
        """This instance is alive: its engine has taken `steps` steps and holds `pending` requests."""
        folder = self.base / HEARTBEAT
        folder.mkdir(exist_ok=True)
        beat = Heartbeat(self.instance, os.getpid(), os.getppid(), steps, pending, time.time(), engine_pid)
        _write_json(folder / f"{self.instance}.json", asdict(beat))

    def faults(self) -> dict:
        return read_faults(self.base)

    def post_stop(self, owner_tag: str, stop_key: str) -> None:
        """Hand a stop to the instance whose tag is `owner_tag` (no file when no such instance
        exists: the handle is not one this model issued)."""
        owner = self.stop_dir / owner_tag
        if owner_tag.isalnum() and owner.is_dir():
            (owner / stop_key).touch()

    def take_stops(self) -> list[str]:
        """The stop keys posted to this instance since the last call (each file is taken once)."""
        try:
            names = os.listdir(self.own_stops)
        except FileNotFoundError:
            return []
        for name in names:
            (self.own_stops / name).unlink(missing_ok=True)
        return names

    def close(self) -> None:
        if self.owned:  # the launcher removes its own directory
            shutil.rmtree(self.own_stops, ignore_errors=True)
