"""Running one system: start its server (our tritonserver, vLLM's or llama.cpp's OpenAI server), sweep
the client counts against it, stop it. One server at a time, so systems never share the CPU.
The `engine` system is our engine inside this process (no server), built and stopped the same way."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from splitfuse.utils.ports import free_port

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.served.closed_loop import sweep
from perf.served.drivers import EngineDriver, OpenAIDriver, TritonDriver, TritonHttpDriver
from perf.common.systems import (PRECISIONS, VLLM_DTYPES, VLLM_SERVER_ARGS, VLLM_SYSTEMS, base_of, budget_of, file_stem, policy_of,
                                 precision_of, replicas_of)
from perf.common.paths import ROOT
from perf.common.helpers import name_values



def log(msg: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ systems
def engine_params(system: str, args) -> dict[str, str]:
    """Our engine's parameters for a system: its policy, token budget and precision (and for a
    replicated system each replica's share of the cores), then --param. Prefix caching is off, as
    in vLLM's runs (`--no-enable-prefix-caching`), unless --param turns it on."""
    params = {"scheduler_policy": policy_of(system), "token_budget": str(budget_of(system) or args.token_budget),
              "enable_prefix_caching": "false", **PRECISIONS[precision_of(system)]}
    if replicas_of(system) > 1:  # what the launcher gives each replica; recorded with the run
        from splitfuse.launcher.repository import replica_threads

        params["num_threads"] = str(replica_threads(replicas_of(system)))
    params.update(name_values(args.param))
    return params


def run_engine(system: str, args, specs, clients) -> dict:
    """Our engine in this process, driven by the same closed-loop clients: the serving path's
    reference (what Triton, the tokenizing model, gRPC and the client process cost)."""
    from splitfuse.config import split_parameters
    from splitfuse.engine.loop import EngineLoop

    params = engine_params(system, args)
    config, server = split_parameters({"model": str(Path(args.model_dir).resolve()), **params})
    log(f"{system}: building the engine in this process ({params})")
    loop = EngineLoop(config, server=server)
    loop.start()
    try:
        res = _sweep(EngineDriver(loop), specs, clients, args, lambda: [])
    finally:
        loop.shutdown(timeout=60)
    res["server"] = {"kind": "in-process engine", "params": params}
    return res


def run_triton(system: str, args, specs, clients) -> dict:
    """One server per system; if tritonserver dies during a point, it is restarted and that point
    is measured again (up to --max-restarts times per system; the summary reports restarts)."""
    from splitfuse.launcher import serve

    params = engine_params(system, args)
    workdir = (Path(args.workdir) / file_stem(system)).resolve()
    points: list[dict] = []
    crashes: list[dict] = []
    offset = 0
    i = 0
    load_before = os.getloadavg()
    t_sweep = time.time()
    while i < len(clients):
        log(f"{system}: starting tritonserver ({params})")
        t0 = time.time()
        try:
            with serve(args.model_dir, params, instances=replicas_of(system), workdir=workdir,
                       ready_timeout_s=600) as srv:
                log(f"{system}: ready in {time.time() - t0:.0f}s at {srv.http_url} (HTTP), {srv.grpc_url} (gRPC)")
                driver = triton_driver(srv, args)
                warmup = args.warmup
                while i < len(clients):
                    c = clients[i]
                    res = sweep(driver, specs, [c], per_client=args.per_client, min_requests=args.min_requests,
                                   max_requests=args.max_requests, time_limit_s=args.point_time_limit,
                                   request_timeout_s=args.request_timeout, warmup=warmup, log=log,
                                   server_pids=lambda: [srv.process.pid], start_offset=offset)
                    warmup = 0
                    point = res["points"][0]
                    if point["metrics"]["errors"] and srv.process.poll() is None:
                        # A dying tritonserver may still be running for a moment after it failed
                        # the requests; give it time, then check it still answers.
                        for _ in range(20):
                            if srv.process.poll() is not None:
                                break
                            time.sleep(0.5)
                        if srv.process.poll() is None and not srv.is_ready():
                            srv.process.kill()
                            srv.process.wait()
                    if srv.process.poll() is not None:
                        crashes.append({"clients": c, "code": srv.process.returncode})
                        log(f"{system}: tritonserver exited during the {c}-client point (code "
                            f"{srv.process.returncode}); see {workdir / 'server.log'}")
                        if len(crashes) <= args.max_restarts:
                            break  # restart the server and measure this point again
                        point["server_crashed"] = srv.process.returncode
                    points.append(point)
                    offset += point["requests"]
                    i += 1
        finally:
            _reap_leftovers(workdir)
    return {"points": points, "wall_s": time.time() - t_sweep, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "server_exits": crashes,
            "server": {"kind": "triton", "model": args.triton_model, "protocol": args.triton_protocol,
                       "instances": replicas_of(system), "params": params}}


def triton_driver(srv, args):
    """The client of our server: `http` streams Triton's generate_stream (server-sent events, read
    by the same code as vLLM's stream), `grpc` tritonclient's gRPC stream."""
    if args.triton_protocol == "grpc":
        return TritonDriver(srv.grpc_url, args.triton_model)
    return TritonHttpDriver(srv.http_url, args.triton_model)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2:].split()[3]) == sid:
            pids.append(int(d.name))
    return pids


def _end_session(sid: int, timeout_s: float = 30.0) -> None:
    """Wait for every process of the server's session to exit (vLLM's data-parallel engine
    processes outlive its API server for a while, and would take CPU from the next system),
    killing what is left after `timeout_s`."""
    deadline = time.time() + timeout_s
    while _session_pids(sid) and time.time() < deadline:
        time.sleep(0.5)
    for pid in _session_pids(sid):
        log(f"stopping leftover process {pid} of session {sid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap_leftovers(workdir: Path) -> None:
    """Stop processes left running from `workdir` (Python-backend stubs outlive a tritonserver
    that crashed). Matched by the work directory's path in their command line, ended by pid."""
    mark = str(Path(workdir).resolve())
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mark in cmd:
            log(f"stopping leftover process {d.name}: {cmd[:100]}")
            try:
                os.kill(int(d.name), signal.SIGTERM)
                time.sleep(2)
                os.kill(int(d.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_vllm_ready(proc: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> None:
    """Poll an OpenAI server (vLLM's, llama-server) on `port` until /health answers 200; raise if
    the process exits first or it is not ready after `timeout_s` (its log, `log_path`, says why)."""
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{proc.args[0]} not ready after {timeout_s:g} s; see {log_path}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT to a server started in a session of its own (`start_new_session=True`), SIGKILL to
    the session if it has not exited after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_vllm(system: str, args, specs, clients) -> dict:
    py = Path(args.vllm_python)
    if not py.exists():
        raise FileNotFoundError(f"{py} not found: install vLLM-CPU first (see perf/README.md)")
    port = free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(args.model_dir).resolve()),
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", VLLM_DTYPES[precision_of(system)], "--max-model-len", str(args.max_model_len),
           "--no-enable-prefix-caching", "--disable-log-stats", *VLLM_SERVER_ARGS.get(base_of(system), []),
           *args.vllm_arg]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    env.pop("VIRTUAL_ENV", None)
    env.update(VLLM_SYSTEMS[base_of(system)])
    env.update(name_values(args.vllm_env))
    res = _run_openai_server(system, cmd, env, port, args, specs, clients)
    res["server"] = {"kind": "openai", "cmd": cmd[1:], "env": {k: env[k] for k in env if k.startswith("VLLM_")}}
    return res


def run_llamacpp(system: str, args, specs, clients) -> dict:
    """llama.cpp's llama-server on the GGUF file behind --model-dir (perf/peers/llamacpp), a slot
    per client of the largest point and --max-model-len tokens of context per slot, driven by the
    same OpenAI-protocol client as vLLM."""
    from perf.peers.llamacpp.tools import gguf_file, server_cmd, version

    port = free_port()
    cmd = server_cmd(gguf_file(args.gguf or args.model_dir), port, args.llamacpp_threads or os.cpu_count() or 1,
                     max(clients), args.max_model_len) + list(args.llamacpp_arg)
    res = _run_openai_server(system, cmd, dict(os.environ), port, args, specs, clients)
    res["server"] = {"kind": "openai", "cmd": cmd, "llamacpp": version()}
    return res


def _run_openai_server(system: str, cmd: list[str], env: dict, port: int, args, specs, clients) -> dict:
    """Start an OpenAI-compatible server in a session of its own, sweep it, stop it."""
    log_path = Path(args.workdir) / file_stem(system) / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"{system}: starting {' '.join(cmd)}")
    t0 = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=str(ROOT))
    try:
        wait_vllm_ready(proc, port, args.vllm_ready_timeout, log_path)
        log(f"{system}: ready in {time.time() - t0:.0f}s on port {port}")
        driver = OpenAIDriver(f"http://127.0.0.1:{port}", "bench")
        return _sweep(driver, specs, clients, args, lambda: [proc.pid])
    finally:
        stop_server(proc)
        _end_session(proc.pid)


def _sweep(driver, specs, clients, args, server_pids) -> dict:
    load_before = os.getloadavg()
    t = time.time()
    res = sweep(driver, specs, clients, per_client=args.per_client, min_requests=args.min_requests,
                   max_requests=args.max_requests, time_limit_s=args.point_time_limit,
                   request_timeout_s=args.request_timeout, warmup=args.warmup, log=log, server_pids=server_pids)
    res["wall_s"] = time.time() - t
    res["loadavg_before"] = load_before
    res["loadavg_after"] = os.getloadavg()
    return res
