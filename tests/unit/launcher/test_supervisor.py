"""The launcher's watchdog and restart budget (splitfuse.launcher.supervisor), over real
heartbeat files written by the llm instances' control board."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from splitfuse.launcher.supervisor import Watchdog, alive
from splitfuse.utils.restarts import RestartBudget, exit_description
from splitfuse.triton_server import control
from splitfuse.triton_server.control import Control


def _board(tmp_path, monkeypatch, instance: str = "llm_0_0") -> Control:
    monkeypatch.setenv(control.ENV, str(tmp_path))
    return Control("llm", instance)


def test_a_replica_that_steps_or_idles_is_healthy(tmp_path, monkeypatch):
    board = _board(tmp_path, monkeypatch)
    dog = Watchdog(tmp_path, step_timeout_s=5)
    me = os.getppid()  # the heartbeat's parent: this test stands in for tritonserver
    board.beat(steps=10, pending=2)
    assert dog.fault(me, now=0.0) is None
    board.beat(steps=11, pending=2)
    assert dog.fault(me, now=100.0) is None  # it stepped
    board.beat(steps=11, pending=0)
    assert dog.fault(me, now=200.0) is None  # idle: no step is owed
    assert dog.in_flight() == 0


def test_a_replica_holding_requests_without_a_step_hangs(tmp_path, monkeypatch):
    board = _board(tmp_path, monkeypatch)
    dog = Watchdog(tmp_path, step_timeout_s=5)
    me = os.getppid()
    board.beat(steps=3, pending=4)
    assert dog.fault(me, now=0.0) is None
    board.beat(steps=3, pending=4)
    assert dog.fault(me, now=4.0) is None
    reason = dog.fault(me, now=6.0)
    assert reason is not None and "hangs" in reason and "4 requests" in reason and "step_timeout_s=5" in reason
    assert dog.in_flight() == 4


def test_an_old_heartbeat_means_a_stopped_replica(tmp_path, monkeypatch):
    board = _board(tmp_path, monkeypatch)
    dog = Watchdog(tmp_path, step_timeout_s=5)
    board.beat(steps=1, pending=0)
    reason = dog.fault(os.getppid(), now_wall=control.read_heartbeats(tmp_path)["llm_0_0"].wall + 6)
    assert reason is not None and "no heartbeat for 6 s" in reason


def test_a_dead_replica_and_beats_of_another_server(tmp_path, monkeypatch):
    _board(tmp_path, monkeypatch)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    assert not alive(dead) and alive(os.getpid())
    folder = tmp_path / control.HEARTBEAT
    folder.mkdir(exist_ok=True)
    beat = {"instance": "llm_0_1", "pid": dead, "ppid": 4242, "steps": 0, "pending": 1, "wall": 0.0}
    (folder / "llm_0_1.json").write_text(json.dumps(beat))
    dog = Watchdog(tmp_path, step_timeout_s=5)
    assert dog.fault(os.getpid()) is None  # an orphan of another server (ppid 4242) is not ours
    reason = dog.fault(4242)
    assert reason == f"replica llm_0_1 (pid {dead}) died"
    dog.reset()
    assert dog.in_flight() == 0


def test_restart_budget_is_a_sliding_window():
    budget = RestartBudget(max_restarts=2, window_s=60)
    assert budget.take(0.0) and budget.take(10.0)
    assert not budget.take(20.0)  # a third within the window
    assert budget.take(61.0)  # the first fell out of the window
    assert not RestartBudget(max_restarts=0).take(0.0)


def test_exit_descriptions():
    assert exit_description(-9) == "killed by SIGKILL" and exit_description(3) == "exit code 3"
    assert exit_description(None) == "still running"
