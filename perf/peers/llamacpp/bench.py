#!/usr/bin/env python
"""llama.cpp's own benchmarks on GGUF files, and the memory-bandwidth floor of decoding them.

    .venv/bin/python perf/peers/llamacpp/bench.py FILE.gguf [FILE.gguf ...] --out results.json
        [-t 2] [-p 512] [-n 64] [-r 2]

For each file: `llama-bench -t T -p P -n N -r R` (prompt processing ppP and generation tgN,
tokens/s), the bytes of weights one generated token reads (every tensor of the file but the
token embedding, of which one row is read; a model with tied embeddings reads it whole as its
output matrix), and the floor those bytes set at the machine's memory read rate
(perf/common/roofline.py: the best of this run and the record for this CPU). The library part
(`llama_bench`, `batched_bench`) is what perf/engine/offline_compare.py runs for its llamacpp system.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: perf/ is a package
from perf.peers.llamacpp.tools import tool, version  # noqa: E402


def llama_bench(gguf: Path, threads: int, prompt: int, gen: int, reps: int) -> dict:
    """llama-bench's pp and tg rates (tokens/s, mean and stddev over `reps`)."""
    cmd = [str(tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res: dict = {"cmd": cmd[1:]}
    for row in json.loads(out):
        key = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        res[key] = {"tokens_per_s": row["avg_ts"], "stddev": row["stddev_ts"]}
        res.setdefault("model_type", row.get("model_type"))
        res.setdefault("cpu_info", row.get("cpu_info"))
    return res


def batched_bench(gguf: Path, threads: int, prompt: int, gen: int, parallel: int) -> dict:
    """llama-batched-bench: `parallel` sequences of `prompt` tokens each, then `gen` tokens each,
    decoded together (t: the whole batch's seconds)."""
    cmd = [str(tool("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(parallel * (prompt + gen) + 16), "-npp", str(prompt), "-ntg", str(gen), "-npl", str(parallel),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
    return {"cmd": cmd[1:], **rows[-1]}


def decode_weight_bytes(gguf: Path) -> dict:
    """Bytes of weights one decode step reads: every tensor but token_embd (one row of it),
    unless no output.weight exists (tied: token_embd is the output matrix, read whole)."""
    import gguf as gg

    r = gg.GGUFReader(str(gguf))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    emb = sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    per_token = sum(sizes.values()) - (0 if tied else emb)
    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {"file_bytes": gguf.stat().st_size, "tensor_bytes": sum(sizes.values()), "decode_read_bytes": per_token,
            "tied_embeddings": tied, "bytes_by_type": types}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=64)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from perf.common.machine import cpu_flags, cpu_model, git_commit
    from perf.common.roofline import Roofline

    roof = Roofline.measure(args.threads, [])
    results = {}
    for f in args.files:
        print(f"[llamacpp] {f.name}: llama-bench ...", flush=True)
        t0, load = time.time(), os.getloadavg()
        res = {**decode_weight_bytes(f), **llama_bench(f, args.threads, args.prompt, args.gen, args.reps),
               "bench_wall_s": time.time() - t0, "loadavg_before": load, "loadavg_after": os.getloadavg()}
        results[f.name] = res
        print(f"[llamacpp] {f.name}: {json.dumps({k: v for k, v in res.items() if k[:2] in ('pp', 'tg')})}",
              flush=True)
    roof = roof.remeasured().with_record()
    for res in results.values():
        floor_s = res["decode_read_bytes"] / (roof.read_gbs * 1e9)
        res["bandwidth_floor"] = {"read_gbs": roof.read_gbs, "s_per_token": floor_s, "tokens_per_s": 1 / floor_s,
                                  "tg_share": res[f"tg{args.gen}"]["tokens_per_s"] * floor_s}
    doc = {"benchmark": "llama-bench + bandwidth floor", "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "llamacpp": version(), "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags()},
           "commit": git_commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "roofline": roof.as_dict(),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, res in results.items():
        fl = res["bandwidth_floor"]
        print(f"[llamacpp] {name}: pp{args.prompt} {res[f'pp{args.prompt}']['tokens_per_s']:.1f} tok/s, "
              f"tg{args.gen} {res[f'tg{args.gen}']['tokens_per_s']:.2f} tok/s; reads "
              f"{res['decode_read_bytes'] / 1e9:.2f} GB/token, floor {fl['tokens_per_s']:.2f} tok/s at "
              f"{fl['read_gbs']:.1f} GB/s (tg = {fl['tg_share']:.2f} of it)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
