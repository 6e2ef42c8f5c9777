"""hidden_args: the secrets' character rule, and the preloaded shim filling in placeholders once
(a value holding a placeholder, even its own, is put in as it is, never expanded again)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from splitfuse.launcher import hidden_args
from splitfuse.launcher.cli import main as launcher_main


@pytest.mark.parametrize("value, why", [
    ("", "empty"),
    ("with space", "position 5"),
    ("tab\there", "position 4"),
    ("new\nline", "position 4"),
    ("clé", "position 3"),
    ("x" * (hidden_args.MAX_SECRET_CHARS + 1), f"at most {hidden_args.MAX_SECRET_CHARS}"),
])
def test_check_secret_refuses_what_a_header_cannot_carry(value, why):
    with pytest.raises(ValueError, match=why) as e:
        hidden_args.check_secret("the admin key", value)
    assert str(e.value).startswith("the admin key ")
    if len(value) > 3:
        assert value not in str(e.value)  # the secret itself is never in the message
    with pytest.raises(ValueError, match=why):
        hidden_args.environment({"ADMIN_KEY": value}, hidden_args.SOURCE, {})


def test_check_secret_takes_every_visible_ascii_character():
    every = "".join(chr(c) for c in range(0x21, 0x7F))
    hidden_args.check_secret("the admin key", every)
    hidden_args.check_secret("the admin key", "x" * hidden_args.MAX_SECRET_CHARS)
    env = hidden_args.environment({"ADMIN_KEY": every}, hidden_args.SOURCE, {"LD_PRELOAD": "before.so"})
    assert env[hidden_args.ENV_PREFIX + "ADMIN_KEY"] == every
    assert env["LD_PRELOAD"] == f"{hidden_args.SOURCE} before.so" and env[hidden_args.PRELOAD_BEFORE] == "before.so"


def test_the_launcher_refuses_an_admin_key_with_a_bad_character(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPLITFUSE_TRITON_ADMIN_KEY", raising=False)
    key = tmp_path / "admin.key"
    key.write_text("admin key with spaces\n")
    argv = ["--model", str(tmp_path / "unused"), "--admin-key-file", str(key), "--render-only",
            "--model-repository-out", str(tmp_path / "repo")]
    assert launcher_main(argv) == 2
    err = capsys.readouterr().err
    assert f"the admin key from {key} has a character that is not visible ASCII (at position 6)" in err
    assert not (tmp_path / "repo").exists()  # refused before any work


def _shim():
    lib = hidden_args.shim()
    if lib is None:
        pytest.skip("no C++ compiler: the argument shim cannot be built here")
    return lib


def _run_filled(secrets: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    """`printf '%s\\n' ARGS...` under the shim: the arguments as its main() sees them."""
    printf = shutil.which("printf") or "/usr/bin/printf"
    env = hidden_args.environment(secrets, _shim(), dict(os.environ))
    # A shim that re-expanded its values would never return: the timeout turns that into a failure.
    return subprocess.run([printf, "%s\\n", *args], env=env, capture_output=True, text=True, timeout=30)


def test_a_secret_holding_its_own_placeholder_is_filled_in_once():
    own = hidden_args.placeholder("ADMIN_KEY")
    value = f"a{own}b{own}"
    proc = _run_filled({"ADMIN_KEY": value}, [f"--key={own}", "plain", own + own])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"--key={value}", "plain", value + value]


def test_a_secret_holding_another_placeholder_is_not_expanded():
    a, b = hidden_args.placeholder("A"), hidden_args.placeholder("B")
    proc = _run_filled({"A": f"x{b}", "B": "bee"}, [f"{a}-{b}"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"x{b}-bee"]


def test_a_placeholder_without_its_secret_stops_the_process():
    proc = _run_filled({"A": "set"}, [hidden_args.placeholder("MISSING")])
    assert proc.returncode == 2 and "SPLITFUSE_SECRET_MISSING is not set" in proc.stderr
