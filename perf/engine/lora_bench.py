#!/usr/bin/env python
"""Multi-LoRA throughput: a batch mixing several adapters against the base model, same workload.

Each engine (`EngineLoop`) in a process of its own, N closed-loop clients there that cost nothing
(a client's next request is submitted from the callback that receives its previous one's final
output, as in engine_closed_loop.py). Per model, the engines' processes stay up side by side and
phases alternate over them (base, mix of 4 adapters, base, ...), one at a time, so the machine's
drift spreads over every system:

* `base`: an engine without adapters, plain requests;
* `all-kN` / `attn-kN`: an engine serving 4 PEFT adapters of rank 16 (all seven projections, or
  attention only: q, k, v, o), every request naming one of the first N adapters in turn;
* `all-base`: the adapter engine with plain requests (what configuring adapters costs base
  requests).

The adapters are made here with peft (random A, random non-zero B; saved under
perf/.cache/lora/). Prompts are random token ids (no two share a prefix; prefix caching off),
generation lengths exact (ignore_eos), greedy. Reported: generated tokens per second per phase,
the median over rounds, and each system's ratio to `base`.

    .venv/bin/python perf/engine/lora_bench.py                # bench model and SmolLM2-135M, ~15 min
    .venv/bin/python perf/engine/lora_bench.py --quick        # bench model only, fewer rounds
    .venv/bin/python perf/engine/lora_bench.py --served       # also through two real tritonservers

`--served` adds, per model, the comparison through Triton: a server without adapters and one with
the 4 adapters on all seven projections, 16 gRPC streaming clients on the ensemble (text prompts
of the same length distribution, tokenized in the server), phases alternating over the servers.

Writes --out (default perf/results/2026-11-27-lora/): result.json and summary.md, with the machine, CPU
flags, commit and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import ROOT, RESULTS  # noqa: E402
from perf.common import paths  # noqa: E402
from perf.common.helpers import name_values  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402
from perf.common.workload import BENCH_MODEL_DIR, ensure_model, random_id_requests  # noqa: E402

from splitfuse.config import EngineConfig  # noqa: E402
from splitfuse.engine.loop import EngineLoop  # noqa: E402
from splitfuse.engine.sequence import SamplingParams  # noqa: E402

CACHE = paths.CACHE / "lora"
ADAPTER_KINDS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
NUM_ADAPTERS = 4
RANK = 16


def make_adapters(model_dir: Path, kind: str) -> dict[str, str]:
    """NUM_ADAPTERS PEFT folders of rank RANK on `kind`'s targets (made once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from splitfuse.models.gguf_checkpoint import transformers_location

    out = {}
    for i in range(NUM_ADAPTERS):
        folder = CACHE / model_dir.name / f"{kind}-r{RANK}-{i}"
        if not (folder / "adapter_model.safetensors").is_file():
            torch.manual_seed(100 + i)
            path, load = transformers_location(model_dir)  # a converted GGUF folder: the file itself
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
            # init_lora_weights=False: B random too (peft's default B = 0 would change nothing).
            config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=ADAPTER_KINDS[kind],
                                init_lora_weights=False, lora_dropout=0.0)
            peft_model = get_peft_model(model, config)
            with torch.no_grad():  # keep the deltas modest: a sane model, not noise
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(0.05)
            peft_model.save_pretrained(str(folder))
        out[f"{kind}{i}"] = str(folder)
    return out


def adapter_params(adapters: dict[str, str]) -> dict[str, str]:
    """The engine parameters that serve `adapters` (name: PEFT folder)."""
    return {"lora_modules": ",".join(f"{n}={p}" for n, p in adapters.items()),
            "max_loras": str(NUM_ADAPTERS), "max_lora_rank": str(RANK)}


def medians_and_ratios(phases: dict[str, list[dict]]) -> dict:
    """Each system's median generated tok/s over its rounds, and its ratio to `base`'s."""
    median = {name: statistics.median(p["tokens_per_s"] for p in runs) for name, runs in phases.items()}
    return {"median_tokens_per_s": median,
            "ratio_to_base": {name: round(v / median["base"], 3) for name, v in median.items()}}


class Closed:
    """One phase: `clients` closed-loop clients over `requests` on one engine."""

    def __init__(self, loop: EngineLoop, requests: list[dict], clients: int, adapters: list[str | None],
                 tag: str) -> None:
        self.loop, self.requests, self.clients, self.adapters, self.tag = loop, requests, clients, adapters, tag
        self.lock = threading.Lock()
        self.next = self.finished = self.tokens = 0
        self.errors: list[str] = []
        self.done = threading.Event()
        self.last_end = 0.0

    def _submit(self) -> None:
        with self.lock:
            i = self.next
            if i >= len(self.requests):
                return
            self.next = i + 1
        r = self.requests[i]
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                lora_name=self.adapters[i % len(self.adapters)])
        self.loop.submit(f"{self.tag}-{i}", r["prompt"], params, self._on_output)

    def _on_output(self, out) -> None:
        if not out.finished:
            return
        with self.lock:
            self.finished += 1
            self.tokens += out.num_tokens - len(out.prompt_token_ids)
            if out.error is not None:
                self.errors.append(out.error)
            self.last_end = time.perf_counter()
            done = self.finished == len(self.requests)
        if done:
            self.done.set()
        else:
            self._submit()

    def run(self, timeout_s: float = 1800.0) -> dict:
        start = time.perf_counter()
        for _ in range(self.clients):
            self._submit()
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"{self.tag}: {self.finished} of {len(self.requests)} requests in {timeout_s} s")
        if self.errors:
            raise RuntimeError(f"{self.tag}: {len(self.errors)} requests failed, e.g. {self.errors[0]}")
        wall = self.last_end - start
        return {"wall_s": round(wall, 3), "tokens_per_s": round(self.tokens / wall, 2),
                "requests_per_s": round(len(self.requests) / wall, 3)}


def _warm(loop: EngineLoop, names: list[str | None]) -> None:
    for name in names:
        done = threading.Event()
        loop.submit(f"warm-{name}", [5] * 40, SamplingParams(max_tokens=4, temperature=0.0, lora_name=name),
                    lambda o, d=done: o.finished and d.set())
        done.wait()


def _engine_process(conn, config: dict[str, str], warm: list[str | None]) -> None:
    """One engine in a process of its own, running the phases the parent sends. Engines share no
    process: two engine threads in one process mean two OpenMP teams, more threads than cores,
    and libgomp then cuts its spin-wait short for every team, which slowed an engine by ~11% on
    2 cores whether or not the other one was busy."""
    loop = EngineLoop(EngineConfig.from_strings(config))
    try:
        runner = loop.start().runner
        _warm(loop, warm)
        conn.send(f"dtype {str(runner.dtype).removeprefix('torch.')}, linear {runner.linear_backend}, "
                  f"attention {runner.attention_backend}, decoder layers in {runner.decoder_layers}")
        while (message := conn.recv()) is not None:
            requests, clients, adapters, tag = message
            conn.send(Closed(loop, requests, clients, adapters, tag).run())
    finally:
        loop.shutdown()
        conn.close()


class EngineProcess:
    def __init__(self, config: dict[str, str], warm: list[str | None]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_engine_process, args=(child, config, warm), daemon=True)
        self.process.start()
        child.close()
        self.info: str = self._receive()

    def _receive(self):
        if not self.conn.poll(1800):
            raise TimeoutError("engine process did not answer in 30 min")
        return self.conn.recv()

    def run(self, requests: list[dict], clients: int, adapters: list[str | None], tag: str) -> dict:
        self.conn.send((requests, clients, adapters, tag))
        return self._receive()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def bench_model(model_dir: Path, params: dict[str, str], clients: int, num_requests: int, prompt_mean: float,
                gen_mean: float, rounds: int, kinds: list[str], ks: list[int], seed: int) -> dict:
    requests = random_id_requests(str(model_dir), num_requests, prompt_mean, gen_mean, seed)
    engines: dict[str, EngineProcess] = {}
    systems: list[tuple[str, str, list[str | None]]] = [("base", "base", [None])]
    try:
        engines["base"] = EngineProcess({"model": str(model_dir), **params}, [None])
        for kind in kinds:
            adapters = make_adapters(model_dir, kind)
            engines[kind] = EngineProcess({"model": str(model_dir), **params, **adapter_params(adapters)},
                                          [None, *adapters])
            names = list(adapters)
            for k in ks:
                systems.append((f"{kind}-k{k}", kind, names[:k]))
            if kind == kinds[0]:
                systems.append((f"{kind}-base", kind, [None]))
        phases: dict[str, list[dict]] = {name: [] for name, _, _ in systems}
        for r in range(rounds):
            for name, key, adapters in systems:
                result = engines[key].run(requests, clients, adapters, f"{name}-{r}")
                phases[name].append(result)
                print(f"[lora_bench] {model_dir.name} round {r} {name}: {result['tokens_per_s']} tok/s", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return {
        "model": str(model_dir), "engines": {key: engine.info for key, engine in engines.items()},
        "params": params, "clients": clients, "num_requests": num_requests, "prompt_mean": prompt_mean,
        "gen_mean": gen_mean, "rounds": rounds,
        "order": [name for name, _, _ in systems],
        "phases": phases,
        **medians_and_ratios(phases),
    }


def bench_served(model_dir: Path, params: dict[str, str], clients: int, num_requests: int, prompt_mean: float,
                 gen_mean: float, rounds: int, seed: int, workdir: Path) -> dict:
    """The same comparison through Triton: two real tritonservers (the base; the 4 adapters on
    all seven projections), gRPC streaming clients on the ensemble (text in, tokenized by its own
    model), phases alternating: base, all-k4 (requests naming the 4 adapters in turn), all-base."""
    import contextlib

    from perf.served.closed_loop import run_point
    from perf.served.drivers import TritonDriver
    from perf.served.fastgen_metrics import summarize
    from perf.common.workload import make_workload

    from splitfuse.launcher import serve

    specs = make_workload(str(model_dir), num_requests, prompt_mean, gen_mean, seed=seed)
    adapters = make_adapters(model_dir, "all")
    names = list(adapters)
    lora_params = {**params, **adapter_params(adapters)}
    with contextlib.ExitStack() as stack:
        servers = {key: stack.enter_context(serve(str(model_dir), p, workdir=workdir / key, ready_timeout_s=600))
                   for key, p in (("base", params), ("all", lora_params))}
        systems = [("base", "base", [None]), ("all-k4", "all", names), ("all-base", "all", [None])]
        drivers = {name: TritonDriver(servers[key].grpc_url, "ensemble", lora_names=lora)
                   for name, key, lora in systems}
        for name, driver in drivers.items():  # warm-up: every adapter loaded, every path run once
            records = run_point(driver, specs[:8], clients=min(clients, 8), num_requests=8)
            if any(not r.ok for r in records):
                raise RuntimeError(f"{name}: warm-up failed: {[r.error for r in records if not r.ok][:1]}")
        phases: dict[str, list[dict]] = {name: [] for name, _, _ in systems}
        for r in range(rounds):
            for name, _, _ in systems:
                records = run_point(drivers[name], specs, clients=clients, num_requests=len(specs))
                m = summarize(records)
                if m["errors"]:
                    raise RuntimeError(f"{name}: {m['errors']} requests failed, e.g. "
                                       f"{next(rec.error for rec in records if not rec.ok)}")
                phases[name].append({"tokens_per_s": round(m["output_tokens_per_s"], 2),
                                     "requests_per_s": round(m["throughput_rps"], 3),
                                     "wall_s": round(m["duration_s"], 3)})
                print(f"[lora_bench] served {model_dir.name} round {r} {name}: "
                      f"{m['output_tokens_per_s']:.1f} tok/s", flush=True)
    return {
        "model": str(model_dir), "served": True, "params": params, "clients": clients,
        "num_requests": len(specs), "prompt_mean": prompt_mean, "gen_mean": gen_mean, "rounds": rounds,
        "engines": {"base": "tritonserver, ensemble (tokenizer + llm), no adapters",
                    "all": f"tritonserver, ensemble, {NUM_ADAPTERS} adapters on all seven projections"},
        "order": [name for name, _, _ in systems], "phases": phases, **medians_and_ratios(phases),
    }


def summary_md(result: dict) -> str:
    m = result["machine"]
    lines = ["# Multi-LoRA throughput (perf/engine/lora_bench.py)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, flags `{m['cpu_flags']}`; commit {m['git_commit']}; "
             f"{result['date']}. The machine may have been shared with other work: phases alternate "
             "(every system once per round, rounds repeated) and medians are reported.", "",
             f"Command: `{result['command']}`", ""]
    for res in result["models"]:
        where = ("gRPC streaming clients on the ensemble of a real tritonserver (text prompts, tokenized "
                 "there)" if res.get("served") else "clients in-process, random ids")
        lines += [f"## {Path(res['model']).name}{' (served)' if res.get('served') else ''}", "",
                  f"{res['clients']} closed-loop {where}, {res['num_requests']} requests per phase "
                  f"(prompts ~N({res['prompt_mean']:g}, 30%), generations ~N({res['gen_mean']:g}, 30%), "
                  f"greedy, ignore_eos), {res['rounds']} rounds; engine parameters {res['params']}; "
                  f"{NUM_ADAPTERS} adapters of rank {RANK}.", ""]
        for key, text in res["engines"].items():
            lines.append(f"- engine `{key}`: {text}")
        lines += ["", "| system | generated tok/s (median) | per round | ratio to base |", "|---|---|---|---|"]
        for name in res["order"]:
            runs = ", ".join(f"{p['tokens_per_s']:.0f}" for p in res["phases"][name])
            median, ratio = res["median_tokens_per_s"][name], res["ratio_to_base"][name]
            lines.append(f"| {name} | {median:.1f} | {runs} | {ratio:.3f} |")
        lines.append("")
    lines += ["`all-kN` / `attn-kN`: every request names one of N adapters (all seven projections / q, k, v, o); "
              "`all-base`: plain requests on the engine serving the `all` adapters.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bench,smollm2", help="comma-separated: bench, smollm2")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-mean", type=float, default=256)
    ap.add_argument("--gen-mean", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="all,attn")
    ap.add_argument("--ks", default="1,2,4", help="adapters in the mix per adapter system")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine parameter (defaults: token_budget=256, enable_prefix_caching=false)")
    ap.add_argument("--quick", action="store_true", help="bench model, 2 rounds, k=4 only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--served", action="store_true",
                    help="also through Triton: two real tritonservers (base; all-k4 and all-base), gRPC clients")
    ap.add_argument("--workdir", default="/tmp/splitfuse-lora-bench", help="--served: the servers' directories")
    ap.add_argument("--out", default=str(RESULTS / "2026-11-27-lora"))
    args = ap.parse_args()
    if args.quick:
        args.models, args.rounds, args.ks = "bench", 2, "4"
    params = {"token_budget": "256", "enable_prefix_caching": "false", **name_values(args.param)}
    result = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "models": []}
    for model in args.models.split(","):
        if model == "bench":
            ensure_model(str(BENCH_MODEL_DIR), "bench")
            model_dir, n, rounds = BENCH_MODEL_DIR, args.num_requests, args.rounds
        elif model == "smollm2":
            from splitfuse.launcher.default_model import default_model

            # 30 layers to the bench model's 8: fewer requests per phase.
            model_dir, n, rounds = default_model(ROOT / "models"), max(16, args.num_requests // 3), args.rounds
        else:
            raise SystemExit(f"unknown model {model!r}")
        result["models"].append(bench_model(Path(model_dir), params, args.clients, n, args.prompt_mean,
                                            args.gen_mean, rounds, args.kinds.split(","),
                                            [int(k) for k in args.ks.split(",")], args.seed))
        if args.served:
            result["models"].append(bench_served(Path(model_dir), params, args.clients, n, args.prompt_mean,
                                                 args.gen_mean, rounds, args.seed, Path(args.workdir) / model))
        out = Path(args.out)  # written after each model: a long run keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
        (out / "summary.md").write_text(summary_md(result))
    print(summary_md(result))
    print(f"wrote {out}/result.json and summary.md")


if __name__ == "__main__":
    main()
