"""The GPU check (issue 63): one command that proves the CUDA paths on a lent GPU machine.

Here, once (fetches the wheels the GPU machine lacks from the package index, for its Python 3.12):

    make gpu-wheels                                   # -> perf/.gpu_carry/*.whl

There (the device tool's `run`, carrying perf/.gpu_carry; nothing is installed from the network):

    python3 perf/gpu_check.py --carry perf/.gpu_carry --out $OUT

Here, in `make test` (tests/perf/test_gpu_check.py): the same steps with `--dry-run`: the carrying,
the package view, every part's child process and timeout, the CUDA test command (its tests skip
without a device) and the benchmarks on a tiny model on the CPU.

Each part runs in a child process of its own under its own timeout (killed with its process
group when past it), so the check never hangs and ends within the sum of the timeouts (7 min 45 s):
  env            the GPU, torch, CUDA and triton versions; what was carried
  cuda-tests     `pytest -m cuda` over the kernel tests (Triton-lang kernels and flash attention
                 against the torch reference, attention also at Llama-3-8B's sizes) and the engine's greedy parity with transformers on
                 cuda (tests/models/test_parity_kernels.py)
  bench-smollm2  offline throughput and single-stream latency, bf16, a random SmolLM2-135M-shaped model,
                 and the share of our greedy tokens transformers' bf16 generate gives too
  bench-8b       the same on a random model with Llama-3-8B's layers (7B parameters, small vocabulary)
It prints one summary line per part and writes to --out only what the device tool brings back (at
most 8 files, flat): results.json, gpu_check.log (every part's output) and cuda-tests.xml; the
carried packages, the models it builds (15 GB for the 8B shape) and the parts' own files stay in
--work.
SmolLM2's trained weights (270 MB) do not fit the 64 MiB a device run carries: the shapes are
built on the device, random, and the token parity runs on the test models.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / "perf" / ".gpu_carry"
# (part, timeout in seconds); the sum bounds the whole check.
PARTS = [("env", 30), ("cuda-tests", 180), ("bench-smollm2", 75), ("bench-8b", 180)]
DRY_PARTS = PARTS + [("timeout-probe", 2)]
CUDA_TEST_PATHS = ["tests/kernels", "tests/models/test_parity_kernels.py"]
# Model shapes (transformers LlamaConfig fields); the tokenizer sets the vocabulary.
SHAPES = {
    "bench-smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, tie_word_embeddings=True),
    "bench-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),
}


# ---- carrying: the wheels the machine lacks, and the package without installing it -------------

def unpack_wheels(carry: Path, site: Path) -> list[dict]:
    """Unpack each wheel of `carry` that is for this interpreter into `site` (a wheel is a zip of
    its import tree); what each holds. A binary wheel of another Python (the dry run's Python
    3.11 against the GPU machine's 3.12) is left out: it would shadow the installed one."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours = set(sys_tags())
    site.mkdir(parents=True, exist_ok=True)
    carried = []
    for wheel in sorted(carry.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(wheel.name)
        usable = bool(ours & set(tags))
        with zipfile.ZipFile(wheel) as z:
            if usable:
                z.extractall(site)
            tops = sorted({n.split("/")[0] for n in z.namelist()
                           if not n.split("/")[0].endswith((".dist-info", ".data"))})
        carried.append({"wheel": wheel.name, "name": str(name), "top_level": tops, "for_this_python": usable})
    return carried


def package_view(site: Path) -> Path:
    """`splitfuse` importable from `site` without installing it: a folder of links to backend/'s
    entries, kernels/ and model_repository/ (pyproject.toml's package-dir)."""
    view = site / "splitfuse"
    view.mkdir(parents=True, exist_ok=True)
    links = {p.name: p for p in (ROOT / "backend").iterdir() if p.name != "__pycache__"}
    links.update({"kernels": ROOT / "kernels", "model_repository": ROOT / "model_repository"})
    for name, target in links.items():
        link = view / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return site


# ---- the parts (each runs in its own child: `--part NAME`) ------------------------------------

def part_env(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    carried = json.loads((Path(args.work) / "carried.json").read_text())
    imported = {}
    for wheel in carried:
        for top in wheel["top_level"]:
            name = top.removesuffix(".py")
            if wheel["for_this_python"] and name.isidentifier():  # not pyzmq.libs and the like
                module = __import__(name)
                imported[name] = str(Path(module.__file__)) if getattr(module, "__file__", None) else None
    import splitfuse
    from perf.common.machine import machine_info

    return {"machine": machine_info(), "gpu": gpu, "cuda_available": cuda,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": sys.version.split()[0], "carried": imported, "splitfuse": splitfuse.__file__,
            "summary": f"{gpu or 'no CUDA device'}; torch {torch.__version__} "
                       f"(CUDA {torch.version.cuda}), triton {triton_version}; carried {', '.join(imported) or 'nothing'}"}


def part_cuda_tests(args) -> dict:
    junit = Path(args.out) / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={junit}", *CUDA_TEST_PATHS]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else proc.stderr.strip()[-300:]
    if proc.returncode != 0:  # 5: nothing collected, a failure here too
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return {"returncode": proc.returncode, "command": " ".join(command[1:]), "summary": last,
            "ok": proc.returncode == 0}


def part_bench(args, name: str) -> dict:
    import torch

    from perf.common.workload import model_info
    from splitfuse import LLM, SamplingParams
    from splitfuse.tools.demo_model import build_model

    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    sizes = dict(prompts=64 if name == "bench-smollm2" else 32, prompt_len=512, gen=128) if cuda else \
        dict(prompts=4, prompt_len=16, gen=8)
    start = time.perf_counter()
    shape = SHAPES[name] if cuda else {}
    path = build_model(Path(args.work) / "models" / name, arch="llama", size="tiny", dtype=dtype,
                       init_device=device, **shape)
    built = time.perf_counter()
    llm = LLM(str(path), dtype=dtype, device=device, token_budget=2048 if cuda else 64, enable_prefix_caching=False,
              kv_cache_memory_gb=16.0 if cuda else 0.25)
    loaded = time.perf_counter()
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (sizes["prompt_len"],), generator=gen).tolist() for _ in range(sizes["prompts"])]
    params = SamplingParams(max_tokens=sizes["gen"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    offline_s = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    one = prompts[0][: max(8, sizes["prompt_len"] // 4)]
    t0 = time.perf_counter()
    llm.generate([one], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([one], params)
    stream_s = time.perf_counter() - t0
    ms_per_token = 1e3 * (stream_s - first_s) / max(1, sizes["gen"] - 1)
    params_b = model_info(str(path))["params_m"] / 1e3
    if name == "bench-smollm2":  # greedy tokens against transformers on the same weights and dtype
        probe = [p[:64] for p in prompts[:8]]
        ours = [o.token_ids for o in llm.generate(probe, SamplingParams(max_tokens=32, temperature=0.0,
                                                                         ignore_eos=True))]
        del llm
        agreement = greedy_agreement(path, dtype, device, probe, ours)
    result = {"device": device, "dtype": dtype, "shape": shape, "vocab": vocab, "parameters_b": round(params_b, 3),
              "build_s": round(built - start, 1), "load_s": round(loaded - built, 1), **sizes,
              "offline_gen_tokens_per_s": round(generated / offline_s, 1),
              "offline_total_tokens_per_s": round((generated + sizes["prompts"] * sizes["prompt_len"]) / offline_s, 1),
              "single_stream_ms_per_token": round(ms_per_token, 3), "single_stream_first_token_ms": round(1e3 * first_s, 1)}
    result["summary"] = (f"{params_b:.2f}B params {dtype} on {device}: offline {result['offline_gen_tokens_per_s']} "
                         f"gen tok/s ({sizes['prompts']} x {sizes['prompt_len']}+{sizes['gen']}), one stream "
                         f"{ms_per_token:.2f} ms/token; built {result['build_s']} s, loaded {result['load_s']} s")
    if name == "bench-smollm2":
        result["greedy_agreement_with_transformers"] = round(agreement, 4)
        result["summary"] += f"; greedy tokens as transformers' {100 * agreement:.1f}%"
    return result


def greedy_agreement(path: Path, dtype: str, device: str, prompts: list[list[int]], ours: list[list[int]]) -> float:
    """Of our greedy tokens, the share that transformers' generate(do_sample=False) gives too,
    counted up to each prompt's first difference (1.0: identical; bf16 may part late)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None  # ours ran with ignore_eos
    same = total = 0
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens),
                                 do_sample=False)[0, len(prompt):].tolist()
        same += next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), len(tokens))
        total += len(tokens)
    return same / total


def part_timeout_probe(args) -> dict:
    time.sleep(60)  # the dry run's proof that a part past its timeout is killed and the check goes on
    return {"summary": "not killed"}


def run_part(args) -> None:
    name = args.part
    if name == "env":
        result = part_env(args)
    elif name == "cuda-tests":
        result = part_cuda_tests(args)
    elif name.startswith("bench-"):
        result = part_bench(args, name)
    else:
        result = part_timeout_probe(args)
    (Path(args.work) / f"{name}.json").write_text(json.dumps(result, indent=1))


# ---- the driver ------------------------------------------------------------------------------

def run_child(name: str, timeout_s: float, args, env: dict) -> dict:
    """One part in its own process group: its result, or why it has none (failed, timed out)."""
    work = Path(args.work)
    (work / f"{name}.json").unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", args.out, "--work", args.work]
    command += ["--dry-run"] if args.dry_run else []
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = round(time.perf_counter() - start, 1)
    if code is None:
        return {"status": "timed out", "seconds": seconds, "summary": f"timed out after {timeout_s} s (killed)"}
    path = work / f"{name}.json"
    if code != 0 or not path.is_file():
        tail = (work / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {"status": "failed", "seconds": seconds, "summary": f"exit {code}: {tail[0][:300]}"}
    result = json.loads(path.read_text())
    ok = result.get("ok", True)
    return {"status": "ok" if ok else "failed", "seconds": seconds, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where results.json and the parts' logs go ($OUT on the device)")
    ap.add_argument("--carry", default=str(CARRY), help="the folder of wheels to unpack (make gpu-wheels)")
    ap.add_argument("--work", help="where the carried packages, the built models and the parts' files go "
                    "(default: a new temporary folder)")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on this CPU machine: tiny models, "
                    "the CUDA tests skip, plus a part that must time out")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    if args.part:
        run_part(args)
        return
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    args.work = str(work)
    site = work / "site"
    carried = unpack_wheels(Path(args.carry), site) if Path(args.carry).is_dir() else []
    (work / "carried.json").write_text(json.dumps(carried, indent=1))
    package_view(site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "dry_run": args.dry_run,
               "carried": carried, "parts": {}}
    parts = DRY_PARTS if args.dry_run else PARTS
    for name, timeout_s in parts:
        result = run_child(name, timeout_s, args, env)
        results["parts"][name] = result
        print(f"[gpu-check] {name}: {result['status']} in {result['seconds']} s: {result['summary']}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with open(out / "gpu_check.log", "w") as log:  # the parts' outputs, the last 200 kB of each
        for name, _ in parts:
            text = (work / f"{name}.log").read_text(errors="replace")[-200_000:]
            log.write(f"===== {name}: {results['parts'][name]['status']} =====\n{text}\n")


if __name__ == "__main__":
    main()
