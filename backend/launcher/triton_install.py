"""Finding tritonserver and giving its Python backend the stub for this interpreter.

Triton comes from the nvidia-pytriton wheel (2.51, one Python-backend stub per Python
version, kept apart from the backend library) or a Triton container's /opt/tritonserver.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TRITON_ROOT_ENV = "SPLITFUSE_TRITON_ROOT"


@dataclass(frozen=True)
class TritonInstall:
    root: Path
    """Directory holding bin/tritonserver."""
    python_backend: Path
    """Directory holding libtriton_python.so and triton_python_backend_utils.py."""
    stub: Path | None
    """Stub for the running Python when it is not already beside libtriton_python.so."""

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"


def find_tritonserver(root: str | os.PathLike | None = None) -> TritonInstall:
    """Locate tritonserver: `root`, $SPLITFUSE_TRITON_ROOT, the nvidia-pytriton wheel, /opt/tritonserver."""
    candidates: list[Path] = []
    if root is not None:
        candidates.append(Path(root))
    elif os.environ.get(TRITON_ROOT_ENV):
        candidates.append(Path(os.environ[TRITON_ROOT_ENV]))
    else:
        try:
            import pytriton  # type: ignore[import-not-found]

            candidates.append(Path(pytriton.__file__).resolve().parent / "tritonserver")
        except ImportError:
            pass
        candidates.append(Path("/opt/tritonserver"))
    tried = []
    for cand in candidates:
        tried.append(str(cand))
        if not (cand / "bin" / "tritonserver").is_file():
            continue
        backend = cand / "backends" / "python"
        if not (backend / "libtriton_python.so").is_file():
            raise FileNotFoundError(f"{cand} has tritonserver but no Python backend at {backend}")
        if (backend / "triton_python_backend_stub").is_file():
            # A Triton container: its stub is built for the container's Python.
            return TritonInstall(cand, backend, None)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = cand / "python_backend_stubs" / ver / "triton_python_backend_stub"
        if not stub.is_file():
            raise FileNotFoundError(f"no Python backend stub for Python {ver} under {cand}")
        return TritonInstall(cand, backend, stub)
    raise FileNotFoundError(
        "tritonserver not found (tried: " + ", ".join(tried) + "); `pip install nvidia-pytriton==0.7.0` "
        f"or set {TRITON_ROOT_ENV}"
    )


def build_backend_dir(dest: str | os.PathLike, install: TritonInstall) -> Path:
    """Make DEST/python with links to the Python backend and the stub for this interpreter.

    The wheel keeps one stub per Python version apart from the backend library, and Triton
    looks for the stub beside the library; linking into a directory of our own avoids
    writing into site-packages.
    """
    dest = Path(dest)
    if install.stub is None:
        return install.python_backend.parent
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": install.python_backend / "libtriton_python.so",
        "triton_python_backend_utils.py": install.python_backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": install.stub,
    }
    for name, target in links.items():
        link = py / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and os.readlink(link) == str(target):
                continue
            link.unlink()
        link.symlink_to(target)
    return dest


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so that its stubs run this interpreter's environment.

    LD_LIBRARY_PATH: without the interpreter's own libpython first, the stub may load the
    system one and fail at `import ssl`. PATH/VIRTUAL_ENV: the stub's embedded interpreter
    finds its prefix (and so site-packages) from them.
    """
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    # Several stubs share few cores: tokenizers' own thread pool only adds contention.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env
