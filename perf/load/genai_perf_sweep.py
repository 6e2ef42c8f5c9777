#!/usr/bin/env python
"""genai-perf concurrency sweep against our Triton server, as a genai-perf user would run it.

For each concurrency level, one `genai-perf profile` call against the `ensemble` (or `llm`)
model over gRPC streaming with TensorRT-LLM tensor names (`--endpoint-type kserve --backend
tensorrtllm`), synthetic prompts sized with the checkpoint's tokenizer, every request
generating exactly its drawn length (`--output-tokens-mean-deterministic` sends `min_length`,
plus `ignore_eos`). genai-perf's own artifacts (its inputs, perf_analyzer's profile export,
genai-perf's JSON/CSV statistics) land under OUT/artifacts/<model>-triton-tensorrtllm-concurrency<N>/;
`genai_perf_report.py` then writes OUT/summary.csv, OUT/summary.md and OUT/sweep.png from them.
(genai-perf 0.0.16's own `--generate-plots` fails on a path bug, so the plots are made here.)

    perf/load/setup_genai_perf.sh                     # once: perf/.venv-genai + perf_analyzer 2.50
    .venv/bin/python perf/load/genai_perf_sweep.py    # start our server on free ports, sweep, report
    .venv/bin/python perf/load/genai_perf_sweep.py --grpc-url 127.0.0.1:8001 --model-dir DIR   # running server

Needs genai-perf (perf/.venv-genai/bin/genai-perf) and the perf_analyzer 2.50 binary
(perf/.cache/perf_analyzer-2.50.0/) that perf/load/setup_genai_perf.sh installs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS, CACHE, VENV_GENAI  # noqa: E402

from perf.load import genai_perf_report  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit, mem_gib  # noqa: E402

from splitfuse.launcher.process import ADMIN_KEY_ENV, GRPC_ADMIN_HEADER  # noqa: E402

GENAI_PERF = VENV_GENAI / "bin" / "genai-perf"
PA_HOME = CACHE / "perf_analyzer-2.50.0"


def tool_env() -> dict[str, str]:
    """genai-perf calls `perf_analyzer` from PATH: the 2.50 binary first, its libraries beside it."""
    env = dict(os.environ)
    env["PATH"] = f"{PA_HOME / 'bin'}:{GENAI_PERF.parent}:{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = f"{PA_HOME / 'lib'}" + (f":{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else "")
    env.pop("VIRTUAL_ENV", None)
    return env


def missing_tools() -> str | None:
    """Why genai-perf cannot run here (None when it can)."""
    if not GENAI_PERF.is_file():
        return f"{GENAI_PERF} not found: run perf/load/setup_genai_perf.sh"
    if not (PA_HOME / "bin" / "perf_analyzer").is_file():
        return f"{PA_HOME}/bin/perf_analyzer not found: run perf/load/setup_genai_perf.sh"
    return None


def profile_command(model: str, grpc_url: str, model_dir: str, concurrency: int, requests: int, args,
                    artifact_dir: Path, admin_key: str | None = None) -> list[str]:
    return [
        str(GENAI_PERF), "profile", "-m", model, "--endpoint-type", "kserve", "--backend", "tensorrtllm",
        "--streaming", "-u", grpc_url, "--tokenizer", str(model_dir),
        "--synthetic-input-tokens-mean", str(args.prompt_mean),
        "--synthetic-input-tokens-stddev", str(round(args.prompt_mean * args.variance)),
        "--output-tokens-mean", str(args.gen_mean),
        "--output-tokens-stddev", str(round(args.gen_mean * args.variance)),
        "--output-tokens-mean-deterministic", "--extra-inputs", "ignore_eos:true",
        "--concurrency", str(concurrency), "--num-prompts", str(max(args.num_prompts, requests)),
        "--request-count", str(requests), "--random-seed", str(args.seed),
        "--artifact-dir", str(artifact_dir),
        "--verbose",  # perf_analyzer's own output goes to the level's log too
        # perf_analyzer reads the model's config, one of Triton's admin APIs the launcher restricts
        # to a header; perf_analyzer takes headers on its command line only.
        *(["--", "-H", f"{GRPC_ADMIN_HEADER}:{admin_key}"] if admin_key else []),
    ]


def requests_at(level: int, per_level: int, minimum: int) -> int:
    return max(minimum, per_level * level)


def sweep(grpc_url: str, model_dir: str, args, out: Path, admin_key: str | None) -> list[dict]:
    """One genai-perf call per level; returns what ran (command, time, exit code)."""
    runs = []
    env = tool_env()
    for level in args.levels:
        n = requests_at(level, args.per_level, args.min_requests)
        artifact_dir = out / "artifacts"  # genai-perf adds <model>-triton-tensorrtllm-concurrency<N>/
        run_dir = f"artifacts/{args.model}-triton-tensorrtllm-concurrency{level}"
        shutil.rmtree(out / run_dir, ignore_errors=True)  # perf_analyzer will not overwrite an export
        cmd = profile_command(args.model, grpc_url, model_dir, level, n, args, artifact_dir, admin_key)
        print(f"[genai_perf_sweep] concurrency {level}: {n} requests", flush=True)
        t = time.time()
        load = os.getloadavg()[0]
        attempts = 0
        while True:
            attempts += 1
            with open(out / "logs" / f"{args.model}-c{level}.log", "w") as log:
                code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(out),
                                      timeout=args.level_timeout).returncode
            export = out / run_dir / "profile_export.json"
            # perf_analyzer 2.50 now and then leaves an empty profile export although every
            # request succeeded (seen at 2 of ~20 levels here); genai-perf then fails to parse
            # it. Such a level runs once more, and the results say so.
            if code == 0 or attempts > 1 or not export.exists() or export.stat().st_size > 0:
                break
            print(f"[genai_perf_sweep] concurrency {level}: empty profile export from perf_analyzer; "
                  "running the level again", flush=True)
            shutil.rmtree(out / run_dir, ignore_errors=True)
        runs.append({"model": args.model, "concurrency": level, "requests": n, "exit_code": code,
                     "attempts": attempts,
                     "wall_s": round(time.time() - t, 1), "loadavg_1m_before": round(load, 2),
                     "loadavg_1m_after": round(os.getloadavg()[0], 2),
                     "artifact_dir": run_dir,
                     "command": shlex.join(["genai-perf", *cmd[1:]]).replace(str(model_dir), "MODEL_DIR")
                                .replace(str(out), "OUT").replace(admin_key or "\0", "$" + ADMIN_KEY_ENV)})
        if code != 0:
            print(f"[genai_perf_sweep] genai-perf exited with {code}; see {out / 'logs'}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc-url", default=None, help="a running server; without it one is started on free ports")
    ap.add_argument("--model-dir", default=str(CACHE / "bench-llama"))
    ap.add_argument("--model-size", default="bench", help="demo_model size built when --model-dir is missing")
    ap.add_argument("--model", default="ensemble", choices=("ensemble", "llm"))
    ap.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels")
    ap.add_argument("--per-level", type=int, default=3, help="requests per concurrent client at each level")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--prompt-mean", type=int, default=256)
    ap.add_argument("--gen-mean", type=int, default=64)
    ap.add_argument("--variance", type=float, default=0.3, help="stddev as a share of the mean")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param", action="append", default=["token_budget=128"], metavar="NAME=VALUE",
                    help="engine parameter for the server started here")
    ap.add_argument("--level-timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(RESULTS / "2026-11-23-genai-perf"))
    ap.add_argument("--note", action="append", default=[], help="line added to the summary's notes")
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.replace(" ", ",").split(",") if x]

    why = missing_tools()
    if why:
        raise SystemExit(why)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (Path(args.model_dir) / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "splitfuse.tools.demo_model", args.model_dir, "--arch", "llama",
                        "--size", args.model_size], check=True)
    model_dir = str(Path(args.model_dir).resolve())
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "git_commit": git_commit(),
            "machine": {"cpu": cpu_model(), "cpu_flags": " ".join(cpu_flags()), "cores": os.cpu_count(),
                        "ram_gib": round(mem_gib(), 1)},
            "command": "perf/load/genai_perf_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model_dir": model_dir, "workload": {"prompt_mean": args.prompt_mean, "gen_mean": args.gen_mean,
                                                 "variance": args.variance, "seed": args.seed},
            "notes": args.note}
    admin_key = os.environ.get(ADMIN_KEY_ENV) or None  # the running server's, or one for ours
    if args.grpc_url:
        meta["server"] = f"running server at {args.grpc_url}"
        meta["runs"] = sweep(args.grpc_url, model_dir, args, out, admin_key)
    else:
        from splitfuse.launcher import serve

        params = dict(p.split("=", 1) for p in args.param)
        meta["server"] = "python -m splitfuse.launcher " + " ".join(f"--param {k}={v}" for k, v in params.items())
        admin_key = admin_key or secrets.token_hex(16)
        with serve(model_dir, params, workdir=CACHE / "genai-perf-server", admin_key=admin_key) as srv:
            meta["runs"] = sweep(srv.grpc_url, model_dir, args, out, admin_key)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    summary = genai_perf_report.report(out)
    print(f"[genai_perf_sweep] wrote {summary}")
    return 0 if all(r["exit_code"] == 0 for r in meta["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
