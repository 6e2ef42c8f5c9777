"""A served replica whose engine runs in its own process keeps torch out of its Triton stub: the
stub starts in a fraction of a second, holds ~150 MB less and exits at once (torch is imported
only by the engine process, or by the stub for an in-process engine or to echo a prompt sent as ids)."""

from __future__ import annotations

import subprocess
import sys


def test_the_llm_stub_imports_without_torch_or_transformers(tmp_path):
    (tmp_path / "triton_python_backend_utils.py").write_text("TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1\n")
    probe = ("import sys; import splitfuse.triton_server.llm_model, splitfuse.lora.stats, splitfuse.engine.wire; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(tmp_path), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
