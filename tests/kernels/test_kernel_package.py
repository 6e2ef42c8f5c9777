"""The package imports lazily and its torch references work without triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import splitfuse.kernels as kernels

EXPECTED = {
    "paged_attention", "paged_attention_reference", "paged_decode_attention_split_kv", "choose_num_splits",
    "write_kv_cache", "write_kv_cache_reference", "rms_norm", "rms_norm_reference", "apply_rotary",
    "apply_rotary_reference", "silu_and_mul", "silu_and_mul_reference", "flash_attn_paged_attention",
    "flash_attn_supported", "paged_attention_flash", "HAS_TRITON", "triton_runnable", "lora_delta",
    "lora_delta_reference",
}


def test_exports_are_the_functions_not_the_modules():
    assert EXPECTED <= set(kernels.__all__)
    import splitfuse.kernels.triton_lang.paged_attention  # noqa: F401
    import splitfuse.kernels.triton_lang.rms_norm  # noqa: F401

    for name in EXPECTED - {"HAS_TRITON"}:
        assert callable(getattr(kernels, name)), name
        assert not isinstance(getattr(kernels, name), type(kernels)), name


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_import_does_not_import_triton():
    proc = _run("""
        import sys
        import splitfuse.kernels
        assert "triton" not in sys.modules, "importing the package imported triton"
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_references_work_without_triton():
    proc = _run("""
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton hidden for this test")

        sys.meta_path.insert(0, NoTriton())
        import torch
        import splitfuse.kernels as k

        assert not k.HAS_TRITON and not k.triton_runnable("cpu")
        x = torch.randn(3, 8)
        k.rms_norm_reference(x, torch.ones(8), 1e-6)
        k.silu_and_mul_reference(torch.randn(3, 8))
        try:
            k.rms_norm(x, torch.ones(8), 1e-6)
        except RuntimeError as exc:
            assert "triton is not installed" in str(exc)
        else:
            raise AssertionError("launcher ran without triton")
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_split_kv_module_imports_on_its_own():
    """No import circle: the split-KV kernel's module imports without paged_attention's."""
    proc = _run("""
        import sys
        import splitfuse.kernels.triton_lang.paged_attention_split_kv
        assert "splitfuse.kernels.triton_lang.paged_attention" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
