"""The benchmark harness end to end: workload, OpenAI driver (fake SSE server), report and plots,
and one tiny sweep against a real tritonserver started on free ports."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root: `perf` is a package

from perf.served import closed_loop  # noqa: E402
from perf.served import drivers  # noqa: E402
from perf.served import fastgen_metrics as fm  # noqa: E402
from perf.common import workload  # noqa: E402
from perf.served import fastgen_report  # noqa: E402
from perf.common import machine  # noqa: E402


# ---------------------------------------------------------------------------------- workload
def test_workload_lengths_are_exact_and_seeded(tiny_llama):
    from transformers import AutoTokenizer

    specs = workload.make_workload(tiny_llama, 12, prompt_mean=40, gen_mean=6, seed=3, max_model_len=256)
    again = workload.make_workload(tiny_llama, 12, prompt_mean=40, gen_mean=6, seed=3, max_model_len=256)
    assert [(s.prompt, s.gen_tokens) for s in specs] == [(s.prompt, s.gen_tokens) for s in again]
    other = workload.make_workload(tiny_llama, 12, prompt_mean=40, gen_mean=6, seed=4, max_model_len=256)
    assert [s.prompt for s in specs] != [s.prompt for s in other]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for s in specs:
        assert len(tok(s.prompt).input_ids) == s.prompt_tokens
        assert s.gen_tokens >= 2 and s.prompt_tokens + s.gen_tokens <= 256
    # No two prompts share their first 8 tokens, so none shares a KV block of 8 or more tokens
    # with another (a prefix cache would otherwise favour the system that has it on).
    many = workload.make_workload(tiny_llama, 64, prompt_mean=40, gen_mean=6, seed=3, max_model_len=256)
    assert len({tuple(tok(s.prompt).input_ids[:8]) for s in many}) == len(many)


# ---------------------------------------------------------------------------------- OpenAI
class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` tokens, 2 per SSE chunk for even requests, like vLLM's format."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        n = body["max_tokens"]
        per = 2 if len(body["prompt"]) % 2 == 0 else 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(obj):
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        done = 0
        while done < n:
            k = min(per, n - done)
            done += k
            time.sleep(0.002)
            send({"choices": [{"text": "ab" * k, "token_ids": list(range(k)),
                               "prompt_token_ids": [1, 2, 3] if done == k else None}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": done}})
        send({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        send(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")


def test_openai_driver_against_fake_sse_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        specs = [workload.RequestSpec(i, "x" * (10 + i), 3, 4 + i) for i in range(6)]
        driver = drivers.OpenAIDriver(f"http://127.0.0.1:{server.server_address[1]}", "bench")
        res = closed_loop.sweep(driver, specs, [1, 3], per_client=2, min_requests=3, warmup=1, log=lambda m: None)
    finally:
        server.shutdown()
    sent = _FakeOpenAI.seen[-1]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["min_tokens"] == sent["max_tokens"]
    p1, p3 = res["points"]
    assert (p1["clients"], p1["requests"]) == (1, 3) and (p3["clients"], p3["requests"]) == (3, 6)
    for p in res["points"]:
        recs = [fm.RequestRecord.from_json(r) for r in p["records"]]
        assert all(r.ok for r in recs), [r.error for r in recs]
        assert all(r.output_tokens == r.gen_tokens == r.server_output_tokens for r in recs)
        assert all(r.server_prompt_tokens == 3 for r in recs)
        assert p["metrics"]["length_mismatches"] == 0
    # Requests are taken in order, continuing between points: same sequence for every system.
    assert sorted(r["idx"] for r in p1["records"]) == [0, 1, 2]
    assert sorted(r["idx"] for r in p3["records"]) == [3, 4, 5, 0, 1, 2] or \
        sorted(r["idx"] for r in p3["records"]) == [0, 1, 2, 3, 4, 5]
    # Even prompts came 2 tokens per chunk.
    multi = [r for r in p3["records"] if len(specs[r["idx"]].prompt) % 2 == 0]
    assert multi and all(all(n == 2 or n == 1 for _, n in r["chunks"]) for r in multi)
    assert p3["metrics"]["multi_token_chunks"] > 0


class _FakeLlamaServer(_FakeOpenAI):
    """llama-server's stream: one text chunk per token, usage only in a last chunk whose choice
    has empty text."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for obj in [*({"choices": [{"text": "ab", "finish_reason": None}]} for _ in range(body["max_tokens"])),
                    {"choices": [{"text": "", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}}]:
            data = b"data: " + json.dumps(obj).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        data = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        self.wfile.flush()


def test_openai_driver_counts_llama_server_tokens_once():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeLlamaServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        driver = drivers.OpenAIDriver(f"http://127.0.0.1:{server.server_address[1]}", "bench")
        rec = driver.run_one(workload.RequestSpec(0, "x", 3, 5), 0, timeout=10)
    finally:
        server.shutdown()
    assert rec.ok and rec.server_output_tokens == 5
    assert [n for _, n in rec.chunks] == [1] * 5


# ---------------------------------------------------------------------------------- report
def _synthetic_raw(out: Path, names: tuple[str, ...] = ("splitfuse", "prefill_first", "vllm")) -> None:
    """Every system gets the same requests; system k's token gaps are 50 * (k + 1) ms, except the
    in-process engine's, which equal the first system's."""
    raw = out / "raw"
    raw.mkdir(parents=True)
    for k, name in enumerate(names):
        points = []
        for c in (1, 2, 4):
            recs = []
            for i in range(c * 2):
                gap = 0.05 * (1 if name == "engine" else k + 1)
                start = i * 0.5
                arrivals = [0.3 + gap * j for j in range(8)]
                recs.append(fm.RequestRecord(i, i % c, 256, 8, start, start + arrivals[-1],
                                             [(start + a, 1) for a in arrivals], None, 256, 8).to_json())
            points.append({"clients": c, "requests": len(recs), "records": recs})
        (raw / f"{name}.json").write_text(json.dumps({"points": points, "server": {"kind": name}, "wall_s": 1.0,
                                                      "loadavg_before": [1, 1, 1], "loadavg_after": [1, 1, 1]}))
    meta = dict(machine=machine.machine_info(), model={"path": "m", "arch": "llama", "params_m": 1.0, "hidden": 8,
                                                       "layers": 1, "heads": 1, "kv_heads": 1, "vocab": 10,
                                                       "dtype": "float32", "built_by": {"size": "tiny"}},
                workload=dict(prompt_mean=256, gen_mean=8, variance=0.3, seed=0, num_requests=8,
                              measured_prompt_mean=256, measured_gen_mean=8),
                clients=[1, 2, 4], per_client=2, min_requests=1, servers={})
    (raw / "meta.json").write_text(json.dumps(meta))


def test_report_writes_plots_csv_and_summary(tmp_path):
    _synthetic_raw(tmp_path)
    summary = fastgen_report.report(tmp_path, token_clients=2)
    text = summary.read_text()
    for png in ("throughput_latency.png", "effective_throughput.png", "token_latency.png"):
        assert (tmp_path / png).stat().st_size > 5000
        assert png in text
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 1 + 3 * 3
    assert "AMD" in text or "Intel" in text or "cores" in text
    # Gaps of 50/100/150 ms: P95 ratio splitfuse / prefill_first = 0.5, effective-throughput ratios 1.
    assert "| splitfuse / prefill_first: P95 token latency @2 clients | 0.50x | <= 0.5x | yes |" in text
    assert "| splitfuse / vllm: max effective throughput @6 tok/s | " in text


def test_report_flags_systems_still_rising_at_the_top_of_the_sweep():
    """A peer whose throughput still rises at the highest client count has not shown its capacity:
    the summary says so, as a ratio against it is then an upper bound."""
    def pt(system, clients, rps):
        return {"system": system, "clients": clients, "completed": 10, "throughput_rps": rps}

    rows = [pt("splitfuse", 16, 15.8), pt("splitfuse", 32, 15.9),  # +0.6%: saturated
            pt("vllm", 8, 7.0), pt("vllm", 16, 9.9), pt("vllm", 32, 11.9)]  # +20%: still rising
    rising = fastgen_report.unsaturated(rows)
    assert set(rising) == {"vllm"}
    lo, hi, rise = rising["vllm"]
    assert (lo, hi) == (16, 32) and abs(rise - (11.9 / 9.9 - 1)) < 1e-9
    text = "".join(fastgen_report._saturation_lines(rows))
    assert "Not saturated" in text and "+20% from 16 to 32 clients" in text
    assert "saturated" in "".join(fastgen_report._saturation_lines(rows[:2]))
    assert "Not saturated" not in "".join(fastgen_report._saturation_lines(rows[:2]))


def test_report_compares_served_with_in_process_engine(tmp_path):
    """The `engine` system (no server) is not a peer: the report gives the served system's share of
    its throughput at each client count, with the >= 0.9x target at the token-latency count."""
    _synthetic_raw(tmp_path, names=("splitfuse", "engine"))
    text = fastgen_report.report(tmp_path, token_clients=2).read_text()
    # Both synthetic systems have the same request timings: share 1.00 everywhere.
    assert "| splitfuse / engine: throughput @2 clients (served share of in-process) | 1.00x | >= 0.9x | yes |" in text
    assert "| splitfuse / engine: throughput @4 clients (served share of in-process) | 1.00x | (info) | - |" in text
    assert "splitfuse / engine: max effective throughput" not in text
    assert "SplitFuse engine in-process (no server)" in text


def test_cpu_model_names_the_family_of_a_generic_model_name(tmp_path):
    # Zen 4 and Zen 5 virtual machines both say "AMD EPYC"; results must tell them apart.
    info = tmp_path / "cpuinfo"
    cpu = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
    info.write_text(cpu.format(n=0) + cpu.format(n=1).replace("26", "25"))
    assert machine.cpu_model(info) == "AMD EPYC (family 26, model 2)"
    info.write_text("model name\t: Some CPU\n")
    assert machine.cpu_model(info) == "Some CPU"


def test_system_names_carry_budget_and_precision():
    from perf.common import systems

    s = "splitfuse@256:bf16"
    assert (systems.base_of(s), systems.budget_of(s), systems.precision_of(s)) == ("splitfuse", 256, "bf16")
    assert systems.float_twin(s) == "splitfuse@256" and systems.file_stem(s) == "splitfuse_b256_bf16"
    assert systems.label_of("vllm_2c:bf16").endswith("(2 compute cores), bf16")
    assert (systems.base_of("vllm_2c"), systems.budget_of("vllm_2c"), systems.precision_of("vllm_2c")) == ("vllm_2c", None, "")
    assert systems.order_key("splitfuse@256") < systems.order_key(s) < systems.order_key("splitfuse@256:int8")
    systems.check_precision("splitfuse@256:int8", vllm=False)
    with pytest.raises(ValueError, match="precision 'int8'"):
        systems.check_precision("vllm_2c:int8", vllm=True)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        systems.check_precision("splitfuse:fp8", vllm=False)


def test_report_compares_each_precision_with_its_own(tmp_path):
    """Our low-precision systems against our float32 (the quantization issue's targets), and each
    vLLM peer against ours in the peer's precision, never across precisions."""
    _synthetic_raw(tmp_path, names=("splitfuse", "splitfuse:bf16", "vllm", "vllm:bf16"))
    text = fastgen_report.report(tmp_path, token_clients=2, relaxed_prompt_tps=10).read_text()
    # Gaps 50 / 100 / 150 / 200 ms for the four systems, in that order.
    assert "| splitfuse:bf16 / splitfuse: max raw throughput | " in text and "| >= 1.5x | no |" in text
    assert "| splitfuse / vllm: P95 token latency @2 clients | 0.33x |" in text
    assert "| splitfuse:bf16 / vllm:bf16: P95 token latency @2 clients | 0.50x |" in text
    assert "- splitfuse:bf16 / vllm:bf16, relaxed SLA" in text and "- splitfuse / vllm, relaxed SLA" in text
    for across in ("splitfuse / vllm:bf16", "splitfuse:bf16 / vllm: ", "splitfuse:bf16 / vllm, "):
        assert across not in text


def test_replicated_systems_serve_with_instances_on_a_share_of_the_cores():
    """splitfuse_r2: our server with two llm replicas, each engine on half the cores; vllm_dp2:
    vLLM with two data-parallel engines, one core each (served only)."""
    import argparse
    import os

    from perf.served import fastgen_servers
    from perf.common import systems

    s = "splitfuse_r2@256:bf16"
    assert (systems.base_of(s), systems.budget_of(s), systems.precision_of(s)) == ("splitfuse_r2", 256, "bf16")
    assert (systems.policy_of(s), systems.replicas_of(s)) == ("splitfuse", 2)
    assert (systems.policy_of("engine@256"), systems.replicas_of("engine@256")) == ("splitfuse", 1)
    assert (systems.policy_of("prefill_first"), systems.replicas_of("splitfuse@256")) == ("prefill_first", 1)
    args = argparse.Namespace(token_budget=512, param=[])
    params = fastgen_servers.engine_params(s, args)
    assert params["scheduler_policy"] == "splitfuse" and params["token_budget"] == "256"
    assert params["num_threads"] == str(max(1, len(os.sched_getaffinity(0)) // 2)) and params["dtype"] == "bfloat16"
    assert "num_threads" not in fastgen_servers.engine_params("splitfuse@256", args)
    assert systems.float_twin(s) == "splitfuse_r2@256" and systems.file_stem(s) == "splitfuse_r2_b256_bf16"
    assert systems.label_of(s) == "SplitFuse (ours), 2 replicas, budget 256, bf16"
    assert systems.VLLM_SERVER_ARGS["vllm_dp2"] == ["--data-parallel-size", "2"]
    assert systems.VLLM_SYSTEMS["vllm_dp2"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    systems.check_precision("vllm_dp2:bf16", vllm=True)
    assert systems.order_key("splitfuse@256:bf16") < systems.order_key(s) < systems.order_key("vllm_dp2:bf16")


def test_a_stopped_server_leaves_no_process_of_its_session_behind():
    """vLLM's data-parallel engines outlive its API server for a while: the next system must not
    start while they still run, and what is left after the timeout is killed."""
    import subprocess

    from perf.served import fastgen_servers

    lead = subprocess.Popen(["bash", "-c", "sleep 1.5 & exit 0"], start_new_session=True)
    lead.wait()
    assert fastgen_servers._session_pids(lead.pid)  # the child outlives its parent
    t0 = time.time()
    fastgen_servers._end_session(lead.pid, timeout_s=20)
    assert not fastgen_servers._session_pids(lead.pid) and time.time() - t0 < 10
    lead = subprocess.Popen(["bash", "-c", "sleep 60 >/dev/null & echo $!; exit 0"], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    child = int(lead.communicate()[0])
    fastgen_servers._end_session(lead.pid, timeout_s=0.5)

    def ended() -> bool:  # gone, or a zombie waiting for init to reap it
        try:
            return Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.time() + 10
    while time.time() < deadline and not ended():
        time.sleep(0.1)
    assert ended()


def test_report_compares_every_headline_system_with_the_peers(tmp_path):
    """--headline-system takes several of our systems: each gets its rows against every peer, and
    the float32 twins' precision rows appear once."""
    _synthetic_raw(tmp_path, names=("splitfuse", "splitfuse:bf16", "splitfuse_r2:bf16", "vllm_2c:bf16",
                                    "vllm_dp2:bf16"))
    text = fastgen_report.report(tmp_path, token_clients=2,
                                 headline_system="splitfuse:bf16,splitfuse_r2:bf16").read_text()
    # Gaps 50 .. 250 ms for the five systems, in that order.
    assert "| splitfuse:bf16 / vllm_dp2:bf16: P95 token latency @2 clients | 0.40x | <= 1x | yes |" in text
    assert "| splitfuse_r2:bf16 / vllm_2c:bf16: P95 token latency @2 clients | 0.75x | <= 1x | yes |" in text
    assert "| splitfuse_r2:bf16 / vllm_dp2:bf16: max raw throughput | " in text
    assert text.count("| splitfuse:bf16 / splitfuse: max raw throughput | ") == 1


def _check_sweep_point(p: dict) -> None:
    """Every request of a point (per_client=2, min_requests=2) completed with exactly its drawn
    lengths, as the server counted them, its tokens timed between its start and end."""
    recs = [fm.RequestRecord.from_json(r) for r in p["records"]]
    assert len(recs) == p["requests"] == max(2, 2 * p["clients"])
    assert all(r.ok for r in recs), [r.error for r in recs]
    for r in recs:
        assert r.output_tokens == r.gen_tokens == r.server_output_tokens
        assert r.server_prompt_tokens == r.prompt_tokens
        assert r.start < r.chunks[0][0] <= r.chunks[-1][0] <= r.end
    m = p["metrics"]
    assert m["throughput_rps"] > 0 and m["token_latency_p95_s"] > 0
    assert m["length_mismatches"] == 0


# ---------------------------------------------------------------------------------- Triton
@pytest.mark.serving
def test_tiny_sweep_against_real_triton_server(tiny_llama, tmp_path):
    from splitfuse.launcher import find_tritonserver, serve

    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(f"no tritonserver: {e}")
    specs = workload.make_workload(tiny_llama, 8, prompt_mean=32, gen_mean=5, seed=0, max_model_len=256)
    params = {"scheduler_policy": "splitfuse", "token_budget": "64", "device": "cpu", "num_kv_blocks": "64",
              "num_threads": "1"}
    with serve(tiny_llama, params, workdir=tmp_path / "srv") as srv:
        for model in ("ensemble", "llm"):
            for driver in (drivers.TritonDriver(srv.grpc_url, model), drivers.TritonHttpDriver(srv.http_url, model)):
                res = closed_loop.sweep(driver, specs, [1, 2], per_client=2, min_requests=2, warmup=1,
                                        log=lambda m: None)
                for p in res["points"]:
                    _check_sweep_point(p)
        # An error from the server (here: the prompt does not fit max_model_len) is the request's error.
        too_long = workload.RequestSpec(99, specs[0].prompt, specs[0].prompt_tokens, 10_000)
        refused = drivers.TritonHttpDriver(srv.http_url, "ensemble").run_one(too_long, 0, timeout=30)
        assert not refused.ok and "max_model_len" in refused.error, refused.error


# ---------------------------------------------------------------------------------- in-process engine
def test_tiny_sweep_against_in_process_engine(tiny_llama):
    from splitfuse.config import EngineConfig
    from splitfuse.engine.loop import EngineLoop

    specs = workload.make_workload(tiny_llama, 8, prompt_mean=32, gen_mean=5, seed=0, max_model_len=256)
    loop = EngineLoop(EngineConfig(model=tiny_llama, token_budget=64, device="cpu", num_kv_blocks=64, num_threads=1))
    loop.start()
    try:
        res = closed_loop.sweep(drivers.EngineDriver(loop), specs, [1, 3], per_client=2, min_requests=2, warmup=1,
                                log=lambda m: None)
        # A request the engine refuses comes back as that request's error, not an exception.
        too_long = workload.RequestSpec(99, specs[0].prompt, specs[0].prompt_tokens, 10_000)
        refused = drivers.EngineDriver(loop).run_one(too_long, 0, timeout=10)
    finally:
        loop.shutdown(timeout=30)
    for p in res["points"]:
        _check_sweep_point(p)
    assert not refused.ok and "max_model_len" in refused.error
    assert loop.engine.blocks.num_used_blocks == 0


def test_engine_closed_loop_runs_every_request_to_its_length(tiny_llama):
    from perf.engine.engine_closed_loop import run

    requests = workload.random_id_requests(tiny_llama, 7, 40, 6, seed=1)
    result = run(tiny_llama, {"token_budget": "64", "enable_prefix_caching": "false"}, clients=3, requests=requests,
                 timeout_s=120)
    assert result["prompt_tokens_computed"] == sum(len(r["prompt"]) for r in requests)
    assert result["tokens_generated"] == sum(r["max_tokens"] for r in requests)
    steps = result["decode_only_steps"]["steps"] + result["steps_with_prompt_tokens"]["steps"]
    assert steps > 0 and result["requests_per_s"] > 0


def test_served_shares_are_the_served_runs_requests_split_between_engines(tiny_llama):
    specs = workload.make_workload(tiny_llama, 9, 40, 6, workload.VARIANCE, seed=3, max_model_len=2048)
    shares = [workload.served_id_requests(tiny_llama, 9, 40, 6, seed=3, part=k, parts=2) for k in (0, 1)]
    assert [len(s) for s in shares] == [5, 4]
    merged = [shares[i % 2][i // 2] for i in range(9)]
    assert [len(r["prompt"]) for r in merged] == [s.prompt_tokens for s in specs]
    assert [r["max_tokens"] for r in merged] == [s.gen_tokens for s in specs]


def test_priority_bench_splits_a_run_into_its_classes_over_the_window(tiny_llama):
    from perf.engine.priority_bench import measure

    requests = workload.random_id_requests(tiny_llama, 64, 40, 6, seed=1)
    result = measure(tiny_llama, {"token_budget": "64", "max_num_seqs": "2", "stream_interval": "1"}, [5, 0, 0],
                     high_clients=1, requests=requests, duration_s=3.0, warmup_s=0.5)
    high, others, every = result["high_class"], result["others"], result["all"]
    assert high["completed"] > 0 and others["completed"] > 0
    assert high["completed"] + others["completed"] == every["completed"]
    assert every["length_mismatches"] == 0 and result["errors_in_window"] == 0


def test_cpu_split_takes_each_llm_stubs_busiest_thread_as_its_engine():
    from perf.served import served_cpu_split

    before = {("llm stub", 10, 10): 1.0, ("llm stub", 10, 11): 5.0, ("llm stub", 10, 12): 0.5,
              ("llm stub", 20, 21): 2.0, ("llm stub", 20, 22): 0.0,
              ("tritonserver", 1, 1): 3.0, ("client", 2, 2): 0.0}
    after = {("llm stub", 10, 10): 1.5, ("llm stub", 10, 11): 13.0, ("llm stub", 10, 12): 1.0,
             ("llm stub", 20, 21): 2.5, ("llm stub", 20, 22): 7.5,
             ("tritonserver", 1, 1): 4.5, ("client", 2, 2): 0.5,
             ("preprocessing stub", 3, 3): 0.2}  # a thread that appeared meanwhile counts from 0
    cores = served_cpu_split.split(before, after, seconds=10.0)
    assert cores["engine threads"] == pytest.approx((8.0 + 7.5) / 10)
    assert cores["llm stubs, other threads"] == pytest.approx((0.5 + 0.5 + 0.5) / 10)
    assert cores["tritonserver"] == pytest.approx(0.15)
    assert cores["client"] == pytest.approx(0.05)
    assert cores["preprocessing stub"] == pytest.approx(0.02)


def test_cpu_split_takes_each_engine_process_busiest_thread_as_its_engine():
    """engine_process=true: the stubs hold no engine thread; every stub thread is serving path."""
    from perf.served import served_cpu_split

    before = {("llm stub", 10, 10): 1.0, ("llm stub", 10, 11): 2.0, ("engine process", 30, 30): 0.0,
              ("engine process", 30, 31): 4.0, ("engine process", 30, 32): 1.0}
    after = {("llm stub", 10, 10): 1.5, ("llm stub", 10, 11): 4.0, ("engine process", 30, 30): 0.5,
             ("engine process", 30, 31): 12.0, ("engine process", 30, 32): 1.5}
    cores = served_cpu_split.split(before, after, seconds=10.0)
    assert cores["engine threads"] == pytest.approx(0.8)
    assert cores["llm stubs, other threads"] == pytest.approx((0.5 + 2.0) / 10)
    assert cores["engine processes, other threads"] == pytest.approx((0.5 + 0.5) / 10)


def test_burst_ttft_counts_the_opening_burst(tmp_path, capsys, monkeypatch):
    """Three requests start together (512-token prompts: first token due in 1 s), one later."""
    import gzip

    from perf.served import burst_ttft

    def rec(idx, start, first, prompt=512):
        chunks = [(start + first, 1)] + [(start + first + 0.1 * k, 1) for k in range(1, 4)]
        return {"idx": idx, "client": idx, "prompt_tokens": prompt, "gen_tokens": 4, "start": start,
                "end": chunks[-1][0], "chunks": chunks, "error": None}

    records = [rec(0, 10.0, 0.5), rec(1, 10.05, 0.9), rec(2, 10.0, 1.5), rec(3, 12.0, 0.2)]
    (tmp_path / "raw").mkdir()
    with gzip.open(tmp_path / "raw" / "ours.json.gz", "wt") as f:
        json.dump({"points": [{"clients": 3, "records": records}]}, f)
    monkeypatch.setattr(sys, "argv", ["burst_ttft.py", "--clients", "3", str(tmp_path)])
    burst_ttft.main()
    out = capsys.readouterr().out
    assert "burst 3, first token in time 2, SLA met 2; later SLA met 1/1" in out
    assert "mean 0.97 s, median 0.90 s, max 1.50 s" in out


def test_kv_tiers_bench_takes_turns_round_robin_after_their_conversations_previous_turn():
    from perf.served import kv_tiers_bench as ktb
    from perf.served.prefix_cache_bench import Conversation, Turn

    convs = [Conversation(i, f"Doc {i}.", [f" u{i}.{k}" for k in range(3)], [2, 2, 2]) for i in range(4)]
    lock, started = threading.Lock(), []

    class Driver:
        def run(self, prompt, gen, idx, client, timeout):
            with lock:
                started.append(idx)
            start = time.perf_counter()
            time.sleep(0.01 * (idx % 3))  # turns finish out of order
            end = time.perf_counter()
            rec = fm.RequestRecord(idx, client, len(prompt), gen, start=start, end=end,
                                   chunks=[(start, 1), (end, 1)])
            return Turn(rec.to_json(), cached_tokens=0, text=f"<a{idx}>")

    answers: dict[int, list[str]] = {}
    turns = ktb.run_round_robin(Driver(), convs, 3, 10.0, answers)
    assert len(turns) == 12 and all(t.record["error"] is None for t in turns)
    # round-robin: the turns are taken turn 1 of each, then turn 2 of each, ...; a conversation's
    # turn starts only once its previous turn has ended
    by_idx = {t.record["idx"]: t.record for t in turns}
    assert sorted(by_idx) == sorted(c * 100 + k for c in range(4) for k in range(3))
    for c in range(4):
        for k in (1, 2):
            assert by_idx[c * 100 + k]["start"] >= by_idx[c * 100 + k - 1]["end"]
            assert started.index(c * 100 + k) > started.index(c * 100 + k - 1)
    assert answers[2] == ["<a200>", "<a201>", "<a202>"]
    summary = ktb.summarize_turns([{"record": t.record, "turn": t.turn, "cached_tokens": t.cached_tokens}
                                   for t in turns])
    assert summary["ttft_later_n"] == 8 and summary["computed_prompt_tokens"] == summary["prompt_tokens"]
