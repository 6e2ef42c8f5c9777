"""Children that die with the launcher, however it dies.

The launcher starts tritonserver and the OpenAI front in sessions of their own (so a terminal's
Ctrl-C reaches only the launcher, which then drains them in order). Their own sessions also mean
nothing ends them when the launcher is killed outright (the OOM killer, `kill -9`, a supervisor's
timeout): they ran on as orphans holding the ports, and the next start failed. Linux's
PR_SET_PDEATHSIG has the kernel send them SIGKILL when the launcher's thread that started them
ends; Triton's Python-backend stubs watch their parent and exit when tritonserver is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that makes the child get SIGKILL when this process
    dies; None where the kernel has no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:  # runs in the child between fork and exec
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call above took effect
            os._exit(1)

    return preexec


def python_executable() -> str:
    """The Python interpreter of this environment, for the processes the engine starts (tensor-
    parallel ranks, the grammar compiler): inside Triton's stub `sys.executable` is the stub."""
    exe = Path(sys.executable) if sys.executable else None
    if exe is not None and exe.name.startswith("python"):
        return str(exe)
    roots = [Path(sys.prefix), Path(os.environ["VIRTUAL_ENV"])] if "VIRTUAL_ENV" in os.environ else [Path(sys.prefix)]
    for root in roots:
        for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3", "python"):
            if (root / "bin" / name).is_file():
                return str(root / "bin" / name)
    raise RuntimeError(f"no Python interpreter found to start a child process with "
                       f"(sys.executable={sys.executable!r}, sys.prefix={sys.prefix!r})")
