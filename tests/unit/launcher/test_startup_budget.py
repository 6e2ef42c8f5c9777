"""The launcher's default --ready-timeout (startup_budget.py): a base plus a rate per GB of the
checkpoint each replica loads, a draft model counted too, logged with its figures; an explicit
--ready-timeout is kept as given."""

from __future__ import annotations

from splitfuse.launcher import cli
from splitfuse.launcher.startup_budget import (READY_BASE_S, READY_S_PER_GB, checkpoint_bytes,
                                               default_ready_timeout, ready_timeout_for)


def _checkpoint(path, sizes: dict[str, int]):
    path.mkdir(parents=True)
    for name, size in sizes.items():
        with open(path / name, "wb") as f:
            f.truncate(size)  # sparse: the size counts, no bytes written
    return path


def test_the_budget_grows_with_the_bytes_and_the_replicas(tmp_path):
    model = _checkpoint(tmp_path / "m", {"config.json": 100, "model-00001.safetensors": 3_000_000,
                                         "model-00002.safetensors": 2_000_000})
    assert checkpoint_bytes(model) == 5_000_100
    assert checkpoint_bytes(model / "model-00001.safetensors") == 3_000_000  # a .gguf file counts as itself
    # Llama-3.1-8B in bf16, 16.06 GB: 600 s + 30 s/GB.
    assert round(ready_timeout_for(16_060_000_000)) == round(READY_BASE_S + READY_S_PER_GB * 16.06) == 1082
    assert ready_timeout_for(10**9, replicas=2) == READY_BASE_S + 2 * READY_S_PER_GB
    draft = _checkpoint(tmp_path / "d", {"model.safetensors": 1_000_000})
    seconds, nbytes = default_ready_timeout(model, {"speculative_model": str(draft)}, replicas=3)
    assert nbytes == 6_000_100 and seconds == ready_timeout_for(6_000_100, 3)


def test_the_launcher_logs_the_default_and_keeps_an_explicit_value(tmp_path, capsys):
    model = _checkpoint(tmp_path / "m", {"model.safetensors": 2_000_000_000})
    args = cli._parser().parse_args(["--model", str(model), "--instances", "2"])
    assert cli._ready_timeout(args, str(model), {}) == READY_BASE_S + READY_S_PER_GB * 4
    assert "splitfuse.launcher: start-up budget 720s: 600s + 30s/GB x 2.00 GB x 2 replica(s)" in capsys.readouterr().err
    args = cli._parser().parse_args(["--model", str(model), "--ready-timeout", "45"])
    assert cli._ready_timeout(args, str(model), {}) == 45.0
    assert capsys.readouterr().err == ""
