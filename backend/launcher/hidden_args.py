"""Secrets for tritonserver's arguments without putting them on its command line.

Triton takes the restricted-API header key only as an argument (`--http-restricted-api=
...:<header>=<value>`), and every local user can read a process's arguments (`ps`,
/proc/<pid>/cmdline). So the launcher writes a placeholder where the secret goes
(`placeholder(name)`), puts the secret in the server's environment (readable by its own user
only), and preloads a small library (csrc/argv_secrets.cpp, built once per machine with the C++
compiler) that swaps the secret in before tritonserver's main() runs. Without a compiler there
is no way to do this; `shim()` then returns None and the launcher says what that means, unless
$SPLITFUSE_ARGV_SHIM names the library built ahead (a container image's runtime has no compiler).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from splitfuse.kernels.toolchain import compile_library, compiler
from splitfuse.utils.cache_dir import cache_dir as splitfuse_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "argv_secrets.cpp"
ENV_PREFIX = "SPLITFUSE_SECRET_"
PRELOAD_BEFORE = "SPLITFUSE_LD_PRELOAD_BEFORE"
PREBUILT_ENV = "SPLITFUSE_ARGV_SHIM"  # the path of a library built ahead, used as it is
# A secret's characters: visible ASCII, what an HTTP header and gRPC metadata carry unchanged
# (the admin key is sent as one) and an argument holds without quoting; and a bound on its length.
SECRET_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
MAX_SECRET_CHARS = 1024


def check_secret(what: str, value: str) -> None:
    """A ValueError naming `what` and the rule unless `value` keeps it (the value is not shown)."""
    if not value:
        raise ValueError(f"{what} is empty")
    if len(value) > MAX_SECRET_CHARS:
        raise ValueError(f"{what} has {len(value)} characters; at most {MAX_SECRET_CHARS} are allowed")
    bad = next((i for i, ch in enumerate(value) if ch not in SECRET_CHARS), None)
    if bad is not None:
        raise ValueError(f"{what} has a character that is not visible ASCII (at position {bad + 1}): only "
                         "'!' to '~' are allowed, no spaces, control characters or non-ASCII letters, since "
                         "it travels as an HTTP header and gRPC metadata value")


def placeholder(name: str) -> str:
    """What to write in an argument where the secret `name` goes."""
    if not name.isidentifier():
        raise ValueError(f"secret name {name!r} must be an identifier")
    return "{splitfuse-secret:" + name + "}"


def cache_dir() -> Path:
    return splitfuse_cache_dir("launcher")


def shim() -> Path | None:
    """The preload library: $SPLITFUSE_ARGV_SHIM when that file exists, else built on first use;
    None without a compiler or when the build fails."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt and Path(prebuilt).is_file():
        return Path(prebuilt)
    cxx = compiler()
    if cxx is None:
        return None
    source = SOURCE.read_bytes()
    out = cache_dir() / f"libsplitfuse_argv_secrets-{hashlib.sha256(source + cxx.encode()).hexdigest()[:16]}.so"
    if out.exists():
        return out
    try:
        compile_library(cxx, ["-O2", "-shared", "-fPIC", "-std=c++17", str(SOURCE)], out)
    except RuntimeError as e:
        log.warning("building the argument shim failed: %s", str(e)[-2000:])
        return None
    return out


def environment(secrets: dict[str, str], library: Path, base: dict[str, str]) -> dict[str, str]:
    """`base` plus what the preloaded `library` needs to fill in `secrets` (name -> value)."""
    env = dict(base)
    for name, value in secrets.items():
        check_secret(f"secret {name}", value)
        env[ENV_PREFIX + name] = value
    before = env.get("LD_PRELOAD", "")
    env[PRELOAD_BEFORE] = before
    env["LD_PRELOAD"] = f"{library} {before}".strip()
    return env
