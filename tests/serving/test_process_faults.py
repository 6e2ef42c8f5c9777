"""Process faults around the launcher (issue 38): when the launcher is killed outright, nothing it
started lives on to hold a port; when tritonserver dies under it, the launcher stops the OpenAI
front and exits 1 with a one-line reason (a supervisor restarts the pod)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitfuse.launcher import find_tritonserver, free_port, port_is_free

pytestmark = pytest.mark.serving


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie, which holds no port and no memory, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Launcher:
    def __init__(self, model: str) -> None:
        self.ports = [free_port() for _ in range(4)]
        cmd = [sys.executable, "-m", "splitfuse.launcher", "--model", model,
               "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]),
               "--metrics-port", str(self.ports[2]), "--openai-port", str(self.ports[3]),
               "--param", "device=cpu", "--param", "num_kv_blocks=256", "--param", "num_threads=1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("splitfuse.launcher: ready"):
                self.ready.set()

    def tree(self) -> dict[str, list[int]]:
        """tritonserver, its stubs and the OpenAI front, by what they are."""
        kids = _children(self.proc.pid)
        comm = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in kids}
        triton = [pid for pid, name in comm.items() if name == "tritonserver"]
        front = [pid for pid in kids if pid not in triton]
        stubs = [s for t in triton for s in _children(t)]
        return {"tritonserver": triton, "front": front, "stubs": stubs}

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def launcher(tiny_llama):
    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    lau = Launcher(tiny_llama)
    started: list[int] = []
    try:
        assert lau.ready.wait(600), lau.log()
        started += [p for group in lau.tree().values() for p in group]
        yield lau
    finally:
        lau.cleanup()
    for pid in started:  # a failed test must not leave an orphan holding ports
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_killing_the_launcher_leaves_no_process_and_no_port(launcher):
    tree = launcher.tree()
    assert len(tree["tritonserver"]) == 1 and len(tree["front"]) == 1 and len(tree["stubs"]) >= 2, tree
    pids = [p for group in tree.values() for p in group]
    launcher.proc.send_signal(signal.SIGKILL)
    launcher.proc.wait()
    assert _wait(lambda: not any(_alive(p) for p in pids), 30), {p: _alive(p) for p in pids}
    assert _wait(lambda: all(port_is_free(port, "127.0.0.1") for port in launcher.ports), 10), launcher.ports


def test_tritonserver_dying_stops_the_front_and_the_launcher_exits_1(launcher):
    tree = launcher.tree()
    os.kill(tree["tritonserver"][0], signal.SIGKILL)
    assert launcher.proc.wait(timeout=60) == 1, launcher.log()
    launcher.reader.join(timeout=5)
    assert "tritonserver died while serving (killed by SIGKILL)" in launcher.log()
    pids = [p for group in tree.values() for p in group]
    assert _wait(lambda: not any(_alive(p) for p in pids), 30), {p: _alive(p) for p in pids}
    assert _wait(lambda: all(port_is_free(port, "127.0.0.1") for port in launcher.ports), 10)
