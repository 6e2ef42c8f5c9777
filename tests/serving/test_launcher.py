"""splitfuse.launcher: rendering the repository, and the CLI's start/Ctrl-C cycle (make serve)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from triton_helpers import GrpcStream, InferenceServerException
from tritonclient.grpc import model_config_pb2

from splitfuse.engine.block_manager import longest_sequence
from splitfuse.config import EngineConfig, parameter_names, split_parameters
from splitfuse.kernels.toolchain import compiler
from splitfuse.launcher import (
    build_backend_dir,
    default_template_dir,
    find_tritonserver,
    free_port,
    parse_params,
    port_is_free,
    render_model_repository,
)
from splitfuse.launcher.process import GRPC_ADMIN_HEADER


def _config(repo: Path, model: str):
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_template_parameters_are_the_engine_and_server_fields():
    """One to one: every EngineConfig and ServerConfig field, once, and nothing else."""
    cfg = _config(default_template_dir(), "llm")
    assert sorted(cfg.parameters) == sorted(parameter_names())
    assert cfg.model_transaction_policy.decoupled


def test_render_fills_model_params_and_instances(tiny_llama, tmp_path):
    repo = render_model_repository(tmp_path / "repo", tiny_llama, {"token_budget": "64", "num_kv_blocks": "32"},
                                   instances=2, preprocessing_instances=3)
    llm = _config(repo, "llm")
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["model"] == str(Path(tiny_llama).resolve())
    assert params["token_budget"] == "64" and params["num_kv_blocks"] == "32"
    cfg, _ = split_parameters(params)
    assert cfg.token_budget == 64 and cfg.tokenizer == cfg.model
    assert [g.count for g in llm.instance_group] == [2]
    pre = _config(repo, "preprocessing")
    assert pre.parameters["tokenizer"].string_value == str(Path(tiny_llama).resolve())
    assert [g.count for g in pre.instance_group] == [3]
    assert (repo / "ensemble" / "1").is_dir() and (repo / "llm" / "1" / "model.py").is_file()


def test_render_shares_the_cores_among_replicas(tiny_llama, tmp_path):
    """Without a num_threads, N replicas get the cores / N each (at least one); one that is given stays."""
    def threads(**kw) -> str:
        repo = render_model_repository(tmp_path / str(len(list(tmp_path.iterdir()))), tiny_llama, **kw)
        return _config(repo, "llm").parameters["num_threads"].string_value

    cores = len(os.sched_getaffinity(0))
    assert threads(instances=2) == str(max(1, cores // 2))
    assert threads(instances=4 * cores) == "1"
    assert threads(params={"num_threads": "3"}, instances=2) == "3"
    assert threads() == "0"


def test_render_and_cli_place_replicas_on_numa_nodes(tiny_llama, tmp_path):
    """Replicas given NUMA nodes keep num_threads unset (each takes its node's cores), one node
    each; --instances auto on this machine renders what its topology gives (numa_instances.py)."""
    from splitfuse.launcher.cli import main
    from splitfuse.launcher.numa_instances import resolve_instances

    repo = render_model_repository(tmp_path / "a", tiny_llama, {"numa_nodes": "0,0"}, instances=2)
    placed = {k: v.string_value for k, v in _config(repo, "llm").parameters.items()}
    assert placed["numa_nodes"] == "0,0" and placed["num_threads"] == "0"
    with pytest.raises(ValueError, match="names 1 node.* for 2 llm instance"):
        render_model_repository(tmp_path / "b", tiny_llama, {"numa_nodes": "0"}, instances=2)
    assert main(["--model", tiny_llama, "--instances", "auto", "--render-only",
                 "--model-repository-out", str(tmp_path / "c")]) == 0
    count, params, _ = resolve_instances("auto", {})
    llm = _config(tmp_path / "c", "llm")
    assert [g.count for g in llm.instance_group] == [count]
    assert llm.parameters["numa_nodes"].string_value == params.get("numa_nodes", "")


def test_render_rejects_bad_parameters(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="unknown engine parameter"):
        render_model_repository(tmp_path / "a", tiny_llama, {"token_budgte": "64"})
    with pytest.raises(ValueError, match="token_budget"):
        render_model_repository(tmp_path / "b", tiny_llama, {"token_budget": "lots"})
    with pytest.raises(ValueError, match="scheduler_policy"):
        render_model_repository(tmp_path / "c", tiny_llama, {"scheduler_policy": "fifo"})
    with pytest.raises(FileNotFoundError):
        render_model_repository(tmp_path / "d", tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_params(["token_budget"])
    assert parse_params(["token_budget=64", "dtype=float32"]) == {"token_budget": "64", "dtype": "float32"}
    # Server settings (ServerConfig) go through --param alike; a typo names itself.
    assert parse_params(["stream_interval=2"]) == {"stream_interval": "2"}
    with pytest.raises(ValueError, match="stream_intervall"):
        parse_params(["stream_intervall=2"])
    with pytest.raises(ValueError, match="max_waiting_requests"):
        render_model_repository(tmp_path / "e", tiny_llama, {"max_waiting_requests": "-1"})


def test_backend_dir_links_the_stub_for_this_python(tmp_path):
    try:
        install = find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    backend = build_backend_dir(tmp_path / "backends", install)
    py = backend / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        assert (py / name).exists(), name
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    if install.stub is not None:
        assert f"/{ver}/" in os.readlink(py / "triton_python_backend_stub")
    build_backend_dir(tmp_path / "backends", install)  # idempotent


def _listen_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            if v6:
                ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add(str(ip.ipv4_mapped or ip))  # a v6 socket bound to ::ffff:127.0.0.1
            else:
                found.add(socket.inet_ntoa(raw[::-1]))
    return found


@pytest.mark.serving
def test_cli_serves_and_stops_cleanly_on_sigint(tiny_model_factory, tmp_path):
    """`python -m splitfuse.launcher` (what `make serve` runs): ready line, the OpenAI front
    answering beside Triton, then Ctrl-C with a generation in flight: the generation is aborted
    with a final response, new requests are refused while draining, and the launcher exits 0
    with tritonserver and the front stopped."""
    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # A context long enough that the generation below cannot end before the drain does, however
    # fast the CPU (4,000 tokens took under 2 s on a Zen 5 and the test raced).
    tiny_llama = tiny_model_factory("llama", max_position_embeddings=32768)
    ports = [free_port() for _ in range(4)]
    cmd = [sys.executable, "-m", "splitfuse.launcher", "--model", tiny_llama,  # no --host: the default
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--served-model-name", "tiny/chat",  # passed on to the front
           "--param", "device=cpu", "--param", "num_kv_blocks=2048", "--param", "num_threads=1",
           "--drain-timeout", "0.5", "--model-repository-out", str(tmp_path / "repo")]
    # The operator's admin key, from a file (never on a command line; it needs the compiler).
    admin_key = "cli-admin-" + os.urandom(8).hex() if compiler() is not None else None
    if admin_key:
        (tmp_path / "admin.key").write_text(admin_key + "\n")
        cmd += ["--admin-key-file", str(tmp_path / "admin.key")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready, draining = threading.Event(), threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("splitfuse.launcher: ready"):
                ready.set()
            if line.startswith("splitfuse.launcher: draining"):
                draining.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(600), "".join(lines[-40:])
        openai_url = f"http://127.0.0.1:{ports[3]}/v1"
        time.sleep(0.2)  # the ready message's remaining lines
        assert any(openai_url in line for line in lines), "".join(lines[-40:])
        # By default every listener (Triton's three, the OpenAI front) is on loopback only.
        assert {port: _listen_addresses(port) for port in ports} == {port: {"127.0.0.1"} for port in ports}
        with urllib.request.urlopen(f"{openai_url}/models", timeout=30) as r:
            cards = json.load(r)["data"]
        assert [m["id"] for m in cards] == ["tiny/chat"]
        # The checkpoint's 32768 positions, lowered to what the 2048 blocks hold for one
        # sequence: the engine's limit reaches the front, whose default max_tokens it bounds.
        assert cards[0]["max_model_len"] == longest_sequence(2048, 16, EngineConfig(tiny_llama).kv_watermark) < 32768
        grpc_url = f"127.0.0.1:{ports[1]}"
        admin = grpcclient.InferenceServerClient(grpc_url)
        with pytest.raises(InferenceServerException, match="restricted"):
            admin.get_model_config("llm")
        if admin_key:
            assert admin.get_model_config("llm", headers={GRPC_ADMIN_HEADER: admin_key}).config.name == "llm"
        s = GrpcStream(grpc_url)
        # Far longer than the tiny model generates between the signal and the end of the 0.5 s
        # drain (it makes ~1,400-3,000 tokens/s on these CPUs; the OpenAI front stops first).
        s.send("llm", {"text_input": "hello", "max_tokens": 30000, "temperature": 0.0, "ignore_eos": True,
                       "stream": True})
        for _ in range(3):
            assert s.next()[1] is None
        proc.send_signal(signal.SIGINT)
        assert draining.wait(30), "".join(lines[-40:])
        with GrpcStream(grpc_url) as late:  # refused while draining
            late.send("llm", {"text_input": "hello", "max_tokens": 4})
            assert "shutting down" in (late.collect(timeout=30).error or "")
        rest = s.collect(timeout=60)
        s.close()
        assert rest.error is None and rest.finish_reason == "abort" and rest.responses[-1].final
        assert proc.wait(timeout=60) == 0, "".join(lines[-40:])
        with pytest.raises(OSError):  # the front stopped with the launcher
            urllib.request.urlopen(f"{openai_url}/models", timeout=5)
    finally:
        if proc.poll() is None:  # never leave a tritonserver behind: a second signal kills it
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
    reader.join(timeout=5)
    out = "".join(lines)
    assert "successfully unloaded 'llm'" in out and "tritonserver exited with code 0" in out
    assert all(port_is_free(p, "127.0.0.1") for p in ports)
