"""GGUF blocks kept packed (quantization=gguf / gguf-exact: the file's; q4_0 / q4_1 / q8_0: the
float checkpoint quantized at load) against the same model dequantized to float32 (and bf16),
decode-heavy, offline: issue 42 item 5's figures.

Each round runs every mode once, in a fresh process each (`LLM(...).generate` over 16 short
prompts, greedy, ignore_eos, 128 new tokens each), the modes alternating so a noisy neighbour on
a shared machine hits all of them; the summary takes each mode's best round (the least
disturbed) and lists all. Beside tokens/s: the weights' memory by kind (the engine's count), the
process's resident memory after the run (VmRSS) and its peak (VmHWM: loading still reads the
float32 checkpoint first), and the greedy agreement with float32.

    .venv/bin/python perf/kernels/q4_bench.py --rounds 3                  # SmolLM2-135M-Instruct Q4_1
    .venv/bin/python perf/kernels/q4_bench.py --threads 2 --modes fp32,gguf

Writes perf/results/2026-11-27-q4/result.json and summary.md (machine, CPU flags, commit, command).

`--kernels` times the block kernel alone instead (issue 57): decode-shaped products (1 to 8
rows) over a 2048x2048 and an 8192x2048 weight of random blocks per type (Q4_0, Q4_K, Q6_K,
Q5_0, Q8_0 by default), both forms, the median of repeated calls: GB/s of packed weight read and
rows per second through that one matrix (a token's share of a decode step):

    .venv/bin/python perf/kernels/q4_bench.py --kernels --threads 1
    SPLITFUSE_CPU_ISA=avx2 .venv/bin/python perf/kernels/q4_bench.py --kernels --out perf/results/X-avx2

`--shapes`, `--rows` and `--copies` choose other cases: with `--copies 4` each call takes the next of
four copies of the weight, so a large one (an 8B's 14336x4096 gate_up) is read from memory:

    .venv/bin/python perf/kernels/q4_bench.py --kernels --kinds Q4_K,Q6_K --shapes 14336x4096 --rows 1 --copies 4

Writes kernels.json and kernels.md under --out (default perf/results/2026-11-29-kquant).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import ROOT, RESULTS  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit  # noqa: E402

MODES = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
         "gguf": {"dtype": "float32", "quantization": "gguf"},
         "gguf-exact": {"dtype": "float32", "quantization": "gguf-exact"},
         **{q: {"dtype": "float32", "quantization": q} for q in ("q4_0", "q4_1", "q8_0")}}
CHILD = """
import json, sys, time, resource
from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import build, quant4
cfg = json.loads(sys.argv[1])
llm = LLM(cfg.pop("model"), enable_prefix_caching=False, **cfg.pop("params"))
prompts = [llm.tokenizer(f"Question {i}: tell me something about the number {i}.")["input_ids"] for i in range(cfg["n"])]
llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
t = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=cfg["gen"], temperature=0.0, ignore_eos=True))
wall = time.perf_counter() - t
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
runner = llm.engine.runner
json.dump({"wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs),
           "outputs": [list(o.token_ids) for o in outs], "weights": runner.weight_memory_summary(),
           "weight_bytes": runner.model.weight_memory(), "decoder_layers": runner.decoder_layers,
           "linear_backend": runner.linear_backend, "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
           "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024, "library_isa": build.library_isa(),
           "dot_products": quant4.dot_products()}, open(cfg["out"], "w"))
"""


def run(model: str, params: dict, n: int, gen: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cfg = {"model": model, "params": params, "n": n, "gen": gen, "out": str(out)}
        subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], check=True)
        return json.loads(out.read_text())


def random_blocks(kind: str, n: int, k: int, gen) -> "torch.Tensor":
    """Random bytes as `kind` blocks [n, k / block k * bytes], their fp16 scales small and finite."""
    import torch

    from splitfuse.kernels.cpu import gguf_blocks

    per, bb = gguf_blocks.BLOCK_K[kind], gguf_blocks.BLOCK_BYTES[kind]
    b = torch.randint(0, 256, (n, k // per, bb), generator=gen, dtype=torch.uint8)
    for a in gguf_blocks.FP16_FIELDS[kind]:
        b[..., a:a + 2] = (torch.rand(n, k // per, generator=gen) * 0.01).half().view(torch.uint8).view(n, -1, 2)
    return b.reshape(n, -1)


def kernel_bench(args) -> None:
    import torch

    from splitfuse.kernels.cpu import build, quant4

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows_list, records = [int(r) for r in args.rows.split(",")], []
    for n, k in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
        for kind in args.kinds.split(","):
            blocks = random_blocks(kind, n, k, gen)
            for form in [f for f in quant4.FORMS if f == "float" or kind in quant4.dot_kinds()]:
                # Copies used in turn: with enough of them the weights come from memory, not the caches.
                copies = [quant4.pack_quantized(kind, blocks, form=form) for _ in range(args.copies)]
                packed = copies[0]
                for m in rows_list:
                    x, out = torch.randn(m, k, generator=gen), torch.empty(m, n)
                    for c in copies:
                        quant4.linear(x, c, out=out)
                    times = []
                    for i in range(args.repeats):
                        t = time.perf_counter()
                        quant4.linear(x, copies[i % len(copies)], out=out)
                        times.append(time.perf_counter() - t)
                    med = sorted(times)[len(times) // 2]
                    rec = {"weight": f"{n}x{k}", "kind": kind, "form": form, "rows": m, "us": med * 1e6,
                           "packed_mb": packed.data.numel() / 1e6, "gb_per_s": packed.data.numel() / med / 1e9,
                           "rows_per_s": m / med, "bits_per_weight": packed.data.numel() * 8 / (n * k)}
                    records.append(rec)
                    print(f"[q4 kernels] {rec['weight']} {kind} {form} rows {m}: {rec['us']:.0f} us, "
                          f"{rec['gb_per_s']:.1f} GB/s", flush=True)
    command = " ".join([".venv/bin/python", "perf/kernels/q4_bench.py", *sys.argv[1:]])
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "threads": args.threads,
               "library_isa": build.library_isa(), "dot_products": quant4.dot_products(),
               "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps({"command": command, "commit": git_commit(),
                                                        "machine": machine, "records": records}, indent=1) + "\n")
    lines = ["# GGUF block kernel alone: decode-shaped products", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, {args.threads} thread(s); kernels built for "
             f"{machine['library_isa']} (integer form: {machine['dot_products']}); load average "
             f"{' '.join(machine['loadavg'])}. Commit {git_commit()}.", "", f"Command: `{command}`", "",
             "Median of repeated calls; GB/s = packed weight bytes / time (scales included); rows/s = rows / time.",
             "", "| weight | type | form | bits/weight | "
             + " | ".join(f"{m} row(s): us, GB/s" for m in rows_list) + " |",
             "|---|---|---|---|" + "---|" * len(rows_list)]
    for key in dict.fromkeys((r["weight"], r["kind"], r["form"]) for r in records):
        rs = [r for r in records if (r["weight"], r["kind"], r["form"]) == key]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {rs[0]['bits_per_weight']:.2f} | "
                     + " | ".join(f"{r['us']:.0f}, {r['gb_per_s']:.1f}" for r in rs) + " |")
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"),
                    help="a checkpoint converted from a GGUF file (or the .gguf)")
    ap.add_argument("--modes", default="fp32,gguf,gguf-exact,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="engine num_threads (1 by default: on a machine others load, OpenMP barriers of two "
                         "threads on two busy cores wait for a descheduled peer)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kernels", action="store_true", help="time the block kernel alone (see above)")
    ap.add_argument("--kinds", default="Q4_0,Q4_K,Q6_K,Q5_0,Q8_0", help="with --kernels: block types")
    ap.add_argument("--repeats", type=int, default=30, help="with --kernels: timed calls per case")
    ap.add_argument("--shapes", default="2048x2048,8192x2048", help="with --kernels: weights NxK")
    ap.add_argument("--rows", default="1,2,4,8", help="with --kernels: rows per call")
    ap.add_argument("--copies", type=int, default=1,
                    help="with --kernels: copies of each weight called in turn (several: read from memory)")
    args = ap.parse_args()
    args.out = args.out or RESULTS / ("2026-11-29-kquant" if args.kernels else "2026-11-27-q4")
    if args.kernels:
        return kernel_bench(args)

    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    model = prepare_checkpoint(args.model)
    modes = args.modes.split(",")
    rounds, outputs = [], {}
    for rnd in range(args.rounds):
        for mode in modes:
            r = run(model, {**MODES[mode], "num_threads": args.threads}, args.num_seqs, args.gen_tokens)
            outputs.setdefault(mode, r.pop("outputs"))
            rec = {"round": rnd, "mode": mode, "tok_per_s": r["tokens"] / r["wall_s"], **r,
                   "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
            rounds.append(rec)
            print(f"[q4] round {rnd} {mode}: {rec['tok_per_s']:.0f} tok/s ({r['weights']}; rss {r['rss_mib']:.0f} MiB)",
                  flush=True)
    best = {}
    for rec in rounds:
        if rec["mode"] not in best or rec["tok_per_s"] > best[rec["mode"]]["tok_per_s"]:
            best[rec["mode"]] = rec
    ratios = {f"{m} / fp32": best[m]["tok_per_s"] / best["fp32"]["tok_per_s"] for m in best if "fp32" in best}
    # Per round (the modes of one round ran back to back): the spread of the ratio.
    per_round = {m: [a["tok_per_s"] / b["tok_per_s"] for a in rounds for b in rounds
                     if a["mode"] == m and b["mode"] == "fp32" and a["round"] == b["round"]] for m in best}
    agreement = {}
    for m, outs in outputs.items():
        if m != "fp32" and "fp32" in outputs:
            pre = [common_prefix(a, b) for a, b in zip(outs, outputs["fp32"])]
            agreement[m] = {"identical": sum(p == len(b) for p, b in zip(pre, outputs["fp32"])) / len(pre),
                            "mean_common_prefix": sum(pre) / len(pre), "first_token": sum(p > 0 for p in pre) / len(pre)}
    command = " ".join([".venv/bin/python", "perf/kernels/q4_bench.py", *sys.argv[1:]])
    result = {"benchmark": "offline LLM.generate, decode-heavy, GGUF blocks packed vs dequantized",
              "command": command, "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags()},
              "commit": git_commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model,
              "workload": {"num_seqs": args.num_seqs, "gen_tokens": args.gen_tokens, "threads": args.threads},
              "best": best, "ratios_best": ratios, "ratios_per_round": per_round,
              "greedy_agreement_with_fp32": agreement, "rounds": rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# GGUF blocks packed vs dequantized: decode-heavy offline", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores; flags {' '.join(cpu_flags())}. "
             f"Kernels built for {next(iter(best.values()))['library_isa']} (integer form: "
             f"{next(iter(best.values()))['dot_products']}). Commit {git_commit()}.", "",
             f"Command: `{command}`", "",
             f"Workload: {args.num_seqs} sequences, short prompts (~15 tokens), {args.gen_tokens} generated tokens "
             f"each (greedy, ignore_eos), `LLM.generate`, {args.threads} thread(s), each run in a fresh process, "
             f"modes interleaved over {args.rounds} rounds; best round shown.", "",
             "| mode | tok/s (best) | vs fp32 (best) | vs fp32 per round | weights | RSS after run | peak RSS | "
             "greedy = fp32 | common prefix (mean) | decoder layers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        if m not in best:
            continue
        b, a = best[m], agreement.get(m)
        lines.append(f"| {m} | {b['tok_per_s']:.0f} | {ratios.get(f'{m} / fp32', float('nan')):.2f}x | "
                     f"{', '.join(f'{x:.2f}' for x in per_round.get(m, []))} | {b['weights']} | "
                     f"{b['rss_mib']:.0f} MiB | {b['peak_rss_mib']:.0f} MiB | "
                     + (f"{a['identical'] * 100:.0f}% | {a['mean_common_prefix']:.1f} | " if a else "- | - | ")
                     + f"{b['decoder_layers']} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
