"""The OpenAI front's supervision (supervisor.FrontWatch) over a real child process: the
launcher's OpenAIFront, running a small HTTP server in place of the front (its restart, exit
code and HTTP check are the real ones). A killed child is started again and reported up once it
answers; repeated deaths wait a growing back-off; past the restart budget the launcher is told
to give up. The served path (a killed front back within 10 s, /ready 503 meanwhile) is
tests/serving/test_process_faults.py's."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from splitfuse.launcher.openai_front import OpenAIFront
from splitfuse.launcher.supervisor import FrontWatch, RestartBudget
from splitfuse.utils.ports import free_port


@pytest.fixture
def front():
    port = free_port()
    f = OpenAIFront("unused", "127.0.0.1:1", "127.0.0.1", port, {})
    f.command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    f.start()
    yield f
    f.kill()


def _until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _poll_until_up(watch: FrontWatch, timeout: float = 30.0) -> str | None:
    deadline = time.monotonic() + timeout
    while not watch.up and time.monotonic() < deadline:
        reason = watch.poll()
        if reason is not None:
            return reason
        time.sleep(0.05)
    return None


def test_restart_back_off_doubles_after_the_first_and_is_capped():
    budget = RestartBudget(max_restarts=10, window_s=100, backoff_s=1.0, max_backoff_s=5.0)
    delays = []
    for t in range(6):
        assert budget.take(float(t))
        delays.append(budget.delay())
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_killed_front_is_restarted_and_up_once_it_answers(front, capsys):
    watch = FrontWatch(front, RestartBudget(max_restarts=2, window_s=600, backoff_s=0.3))
    assert _until(front.answers)
    watch.started()
    assert watch.poll() is None and watch.up
    first = front.process.pid
    front.process.send_signal(signal.SIGKILL)
    front.process.wait()
    assert watch.poll() is None and not watch.up  # down: /ready must say 503 now
    assert front.process.pid != first  # the first restart waits for nothing
    assert _poll_until_up(watch) is None and watch.up and watch.restarts == 1
    # The second death within the window waits its back-off before the restart.
    second = front.process.pid
    front.process.send_signal(signal.SIGKILL)
    front.process.wait()
    died = time.monotonic()
    assert watch.poll(died) is None and front.process.pid == second and not front.running()
    assert watch.poll(died + 0.1) is None and not front.running()
    assert watch.poll(died + 0.31) is None and front.process.pid != second
    assert _poll_until_up(watch) is None and watch.restarts == 2
    # A third: past --max-restarts 2, the launcher gives up (and exits 1).
    front.process.send_signal(signal.SIGKILL)
    front.process.wait()
    reason = watch.poll()
    assert reason is not None and "giving up" in reason and "killed by SIGKILL" in reason and not watch.up
    err = capsys.readouterr().err
    assert "the OpenAI front exited (killed by SIGKILL); restarting it" in err and "serves again" in err


def test_a_restarted_front_that_never_answers_is_killed_and_counts_as_an_exit():
    port = free_port()
    f = OpenAIFront("unused", "127.0.0.1:1", "127.0.0.1", port, {})
    f.command = [sys.executable, "-c", "import time; time.sleep(120)"]  # runs, never listens
    f.start()
    try:
        watch = FrontWatch(f, RestartBudget(max_restarts=1, window_s=600), start_timeout_s=5.0)
        watch.started()
        f.process.kill()
        f.process.wait()
        t = time.monotonic()
        assert watch.poll(t) is None and f.running() and watch.restarts == 1
        assert watch.poll(t + 1) is None and f.running() and not watch.up  # still starting
        # Past start_timeout_s: killed, which is one more exit, and the budget of 1 is spent.
        reason = watch.poll(t + 6)
        assert not f.running() and reason is not None and "giving up" in reason
    finally:
        f.kill()
