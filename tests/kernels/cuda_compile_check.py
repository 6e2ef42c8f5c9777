"""Compile every kernel, exactly as its launcher would launch it, for CUDA targets without a GPU.

Run as a script (in its own process: TRITON_INTERPRET must be unset so `@triton.jit` builds real
JITFunctions). The launchers run on small CPU tensors with each kernel object swapped for a
recorder, so the recorded arguments, constexprs and launch options are the launchers' own; each
recording is then compiled down to a cubin with triton's bundled ptxas for sm80 and/or sm90, and
the static shared memory is checked against the target's per-block limit.
Prints one JSON object per compile; exits non-zero if any failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import importlib  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

activation, kv_cache, lora, paged_attention, paged_attention_split_kv, rms_norm, rotary = (
    importlib.import_module(f"splitfuse.kernels.triton_lang.{m}")
    for m in ("activation", "kv_cache", "lora", "paged_attention", "paged_attention_split_kv", "rms_norm", "rotary"))
MODULES = (activation, kv_cache, lora, paged_attention, paged_attention_split_kv, rms_norm, rotary)

SMEM_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory one block may use (A100, H100)
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64"}
_RECORDED: list[tuple[str, object, tuple, dict]] = []


class _Recorder:
    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _RECORDED.append((self.name, self.fn, args, kwargs))
        return launch


def _record(label: str, module, kernel_names: list[str], call) -> list[tuple]:
    saved = {n: getattr(module, n) for n in kernel_names}
    saved_checks = [m.check_launch for m in MODULES]
    _RECORDED.clear()
    try:
        for n in kernel_names:
            setattr(module, n, _Recorder(f"{label}:{n}", saved[n]))
        for m in MODULES:  # CPU tensors without the interpreter: skip the runnable check
            m.check_launch = lambda *a, **k: None
        call()
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)
        for m, check in zip(MODULES, saved_checks):
            m.check_launch = check
    return list(_RECORDED)


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """Types, constexprs, attributes and options as triton's launcher would derive them."""
    options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update(kwargs)
    constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr}
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if name in constexprs:
            sig[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # real allocations are 16-byte aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # triton specialises ints equal to 1 into constants
                sig[name] = "constexpr"
                constexprs[name] = 1
                continue
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:  # ... and marks multiples of 16 so that loads can vectorise
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(v)}")
    return sig, constexprs, attrs, options


def _cases():
    """(label, module, kernel attribute names, call, capabilities) for each configuration."""
    def t(*shape, dtype=torch.float16):
        return torch.zeros(*shape, dtype=dtype)

    def attn(dtype, hq, hkv, d, page, max_q, window=None, splits=None):
        tokens, b = (3 if max_q == 1 else 200), 3
        q = t(tokens, hq, d, dtype=dtype)
        cache = t(64, page, hkv, d, dtype=dtype)
        qsl = torch.zeros(b + 1, dtype=torch.int32)
        sl = torch.zeros(b, dtype=torch.int32)
        bt = torch.zeros(b, 16, dtype=torch.int32)
        return lambda: paged_attention.paged_attention(q, cache, cache, qsl, sl, bt, 0.1, max_q, 4096, window,
                                                       num_splits=splits)

    pa, mod = ["_paged_attention_kernel"], paged_attention
    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    for dtype in (fp16, bf16):
        n = TYPES[dtype]
        yield f"paged_attention/{n}/d128/gqa4/prefill", mod, pa, attn(dtype, 32, 8, 128, 16, 512), (80, 90)
        yield f"paged_attention/{n}/d128/gqa8/decode", mod, pa, attn(dtype, 64, 8, 128, 16, 1, splits=1), (90,)
    yield "paged_attention/fp16/d64/mha/window", mod, pa, attn(fp16, 8, 8, 64, 32, 300, 4096), (90,)
    yield "paged_attention/bf16/d256/gqa8", mod, pa, attn(bf16, 16, 2, 256, 64, 300), (80, 90)
    yield "paged_attention/fp16/d80/gqa2", mod, pa, attn(fp16, 8, 4, 80, 16, 300), (90,)
    yield "paged_attention/fp32/d64", mod, pa, attn(fp32, 4, 4, 64, 16, 300), (90,)
    split, mod = ["_split_kv_partial_kernel", "_split_kv_merge_kernel"], paged_attention_split_kv
    yield "split_kv/fp16/d128/gqa8/window", mod, split, attn(fp16, 64, 8, 128, 16, 1, 1024, splits=8), (80, 90)
    yield "split_kv/bf16/d64/mha", mod, split, attn(bf16, 8, 8, 64, 16, 1, splits=16), (90,)

    for dtype in (torch.float16, torch.bfloat16):
        n = TYPES[dtype]
        k, kc = t(7, 8, 128, dtype=dtype), t(4, 16, 8, 128, dtype=dtype)
        yield (f"kv_cache/{n}", kv_cache, ["_write_kv_cache_kernel"],
               lambda k=k, kc=kc: kv_cache.write_kv_cache(k, k, kc, kc, torch.zeros(7, dtype=torch.int64)), (90,))
        x = t(5, 4096, dtype=dtype)
        yield (f"rms_norm/{n}/residual", rms_norm, ["_rms_norm_kernel"],
               lambda x=x: rms_norm.rms_norm(x, torch.zeros_like(x[0]), 1e-6, residual=x), (90,))
        q, kk = t(5, 32, 128, dtype=dtype), t(5, 8, 128, dtype=dtype)
        yield (f"rotary/{n}", rotary, ["_rotary_kernel"],
               lambda q=q, kk=kk: rotary.apply_rotary(q, kk, torch.zeros(5, dtype=torch.int64),
                                                      t(64, 64, dtype=torch.float32), t(64, 64, dtype=torch.float32)),
               (90,))
        g = t(5, 2 * 14336, dtype=dtype)
        yield f"silu_and_mul/{n}", activation, ["_silu_and_mul_kernel"], lambda g=g: activation.silu_and_mul(g), (90,)
    def lora_case(dtype, rows, n_in, rank, n_out, slots=4, scaled=True):
        x = t(rows, n_in, dtype=dtype)
        ids = torch.zeros(rows, dtype=torch.int64)
        a, b = t(slots, n_in, rank, dtype=dtype), t(slots, rank, n_out, dtype=dtype)
        scales = torch.ones(slots) if scaled else None
        return lambda: lora.lora_delta(x, ids, a, b, scales, out=t(rows, n_out, dtype=dtype))

    lk = ["_lora_shrink_kernel", "_lora_expand_kernel"]
    yield "lora/fp16/decode/r16", lora, lk, lora_case(fp16, 16, 4096, 16, 6144), (80, 90)  # split over `in`
    yield "lora/bf16/prefill/r64", lora, lk, lora_case(bf16, 512, 4096, 64, 14336, scaled=False), (80, 90)
    yield "lora/bf16/r128", lora, lk, lora_case(bf16, 300, 14336, 128, 4096), (90,)
    yield "lora/fp32/r8", lora, lk, lora_case(fp32, 3, 576, 8, 1536), (90,)

    x = t(5, 8192, dtype=torch.bfloat16)
    yield ("rms_norm/bf16/fp32-weight", rms_norm, ["_rms_norm_kernel"],
           lambda: rms_norm.rms_norm(x, torch.zeros(8192), 1e-6), (90,))


def _ptxas_usage(ptx: str, cap: int) -> dict:
    """Registers and spill bytes from `ptxas -v` (informational: spills cost speed, not correctness)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    version = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
    for exe in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newest PTX versions
        path = os.path.join(bin_dir, exe)
        if not os.path.exists(path):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        try:
            arch = "sm_90a" if cap == 90 else f"sm_{cap}"
            r = subprocess.run([path, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True,
                               text=True, timeout=120)
        finally:
            os.unlink(f.name)
        text = r.stdout + r.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores", text)
        if regs:
            return {"registers": int(regs.group(1)), "spill_store_bytes": int(spills.group(1)) if spills else 0}
    return {"ptx_version": version.group(0) if version else None}


def main() -> int:
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    failed = 0
    for label, module, kernels, call, caps in _cases():
        if only and only not in label:
            continue
        for name, fn, args, kwargs in _record(label, module, kernels, call):
            for cap in caps:
                t0 = time.time()
                result = {"kernel": name, "target": f"sm{cap}"}
                try:
                    sig, constexprs, attrs, options = _signature(fn, args, dict(kwargs))
                    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", cap, 32),
                                              options=options)
                    shared = compiled.metadata.shared
                    result.update(ok=shared <= SMEM_LIMIT[cap], shared_bytes=shared, num_warps=options["num_warps"])
                    result.update(_ptxas_usage(compiled.asm["ptx"], cap))
                    if shared > SMEM_LIMIT[cap]:
                        result["error"] = f"needs {shared} B of shared memory, limit {SMEM_LIMIT[cap]}"
                except Exception as exc:
                    result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                                  trace=traceback.format_exc()[-2000:])
                result["seconds"] = round(time.time() - t0, 2)
                failed += not result["ok"]
                print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
