"""The command line: `python -m splitfuse.launcher` (what `make serve` runs).

    python -m splitfuse.launcher --model DIR [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
        [--param NAME=VALUE ...] [--lora NAME=PATH ...] [--instances N|auto] [--model-repository-out DIR]
        [--openai-port 9000 [--served-model-name NAME] [--max-logprob-entries N]]
        [--host 127.0.0.1] [--triton-host 127.0.0.1] [--triton-proxy]

Renders the repository, starts tritonserver in the foreground, prints where it listens once
ready (with --openai-port, starts the OpenAI-compatible front beside it, `splitfuse.openai_api`),
and on Ctrl-C/SIGTERM drains (in-flight generations get --drain-timeout seconds to finish, the
rest are aborted with a final response) before Triton unloads; the OpenAI front stops after the
drain, once its clients have their last events; a second signal kills at once.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from splitfuse.launcher import hidden_args
from splitfuse.launcher.default_model import RANDOM_WARNING, is_random_demo
from splitfuse.launcher.health import HealthServer
from splitfuse.launcher.lora import LORA_MODULES, lora_params, resolve_lora_modules
from splitfuse.launcher.numa_instances import describe, instances_arg, resolve_instances
from splitfuse.launcher.openai_front import OpenAIFront
from splitfuse.launcher.process import ADMIN_APIS, ADMIN_HEADER, ADMIN_KEY_ENV, TritonServer
from splitfuse.launcher.supervisor import FrontWatch, Watchdog
from splitfuse.utils.restarts import RestartBudget, exit_description
from splitfuse.launcher.repository import LLM_MODEL, TEMPLATE_ENV, parse_params, render_model_repository
from splitfuse.launcher.startup_budget import READY_BASE_S, READY_S_PER_GB, default_ready_timeout
from splitfuse.launcher.triton_install import build_backend_dir, find_tritonserver
from splitfuse.models.gguf_checkpoint import prepare_checkpoint
from splitfuse.openai_api.config import API_KEY_ENV, ApiConfig, check_served_model_name, key_from
from splitfuse.triton_server.control import read_limits, write_faults
from splitfuse.utils.cli_help import DefaultsHelpFormatter


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m splitfuse.launcher", description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint directory, or a .gguf file (converted once into the GGUF cache)")
    p.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP/REST inference port")
    p.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC inference port")
    p.add_argument("--metrics-port", type=int, default=8002, help="Triton's Prometheus metrics port (GET /metrics)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the public endpoints bind to: the OpenAI front, Triton's metrics and the health "
                        "port (loopback only by default; 0.0.0.0 exposes them on every interface)")
    p.add_argument("--triton-host", default="127.0.0.1",
                   help="address Triton's HTTP and gRPC inference endpoints bind to (loopback only by default). They "
                        "have no authentication: whoever reaches them runs any request, regex and grammar guides "
                        "included; see --triton-proxy for an authenticated path")
    p.add_argument("--triton-proxy", action="store_true",
                   help="the OpenAI front also forwards Triton's HTTP API (/v2/...) to Triton's HTTP endpoint, "
                        f"behind its API key (needs --openai-port and ${API_KEY_ENV})")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="engine or server parameter (any EngineConfig or ServerConfig field), repeatable")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (a PEFT folder) over the model under NAME, repeatable: requests pick it "
                        "with the lora_name input, OpenAI requests with model=NAME (engine parameter lora_modules; "
                        "--param max_loras=N bounds how many are in memory at once)")
    p.add_argument("--instances", type=instances_arg, default=1, metavar="N",
                   help="llm instance_group count (engine replicas), or auto: one per NUMA node, each pinned to "
                        "its node's cores and memory (one replica on a single-node machine)")
    p.add_argument("--openai-port", type=int, default=0,
                   help="also serve the OpenAI-compatible API on this port (0: not started)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name the OpenAI front lists and accepts, the only one for the base model "
                        "(default: the checkpoint directory's name; needs --openai-port)")
    p.add_argument("--allow-runtime-lora", default=None, metavar="DIR",
                   help="let LoRA adapters in folders under DIR be loaded and unloaded while serving (engine parameter "
                        "lora_load_dir; llm's lora_load / lora_unload inputs, and with --openai-port the front's "
                        "/v1/load_lora_adapter, behind its API key); default: off")
    p.add_argument("--max-logprob-entries", type=int, default=None, metavar="N",
                   help="the OpenAI front's bound on log-probability entries per request (default: the front's, "
                        f"{ApiConfig.max_logprob_entries}; needs --openai-port)")
    p.add_argument("--preprocessing-instances", type=int, default=1,
                   help="preprocessing instance_group count (tokenizer instances in front of the engines)")
    p.add_argument("--model-name-prefix", default="",
                   help="put before our three models' names (<prefix>ensemble, <prefix>llm, <prefix>preprocessing), "
                        "so several LLMs, or ours beside other models, share one repository (default: none)")
    p.add_argument("--model-repository-out", default=None,
                   help="where to render the model repository (default: a temporary directory)")
    p.add_argument("--model-repository-template", default=None,
                   help=f"template repository (default: ${TEMPLATE_ENV} or the source tree's model_repository/)")
    p.add_argument("--triton-root", default=None, help="directory with bin/tritonserver (default: the pytriton wheel)")
    p.add_argument("--ready-timeout", type=float, default=None,
                   help="seconds tritonserver (and, after a fault, a restarted one) may take to report ready before "
                        f"the launcher stops it (default: {READY_BASE_S:.0f} + {READY_S_PER_GB:.0f} per GB of "
                        "checkpoint per replica)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM, seconds in-flight generations get to finish before they are aborted")
    p.add_argument("--exit-timeout", type=int, default=10,
                   help="tritonserver --exit-timeout-secs: time to unload the models after the drain")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level (0: off)")
    p.add_argument("--admin-key-file", default=None,
                   help=f"file whose first line opens Triton's admin APIs ({', '.join(ADMIN_APIS)}) as the "
                        f"'{ADMIN_HEADER}' header (default: ${ADMIN_KEY_ENV}; neither: they are closed)")
    p.add_argument("--open-admin-apis", action="store_true",
                   help="leave Triton's admin APIs open to every client (Triton's own default)")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds a replica may hold requests without an engine step (or go without a heartbeat) "
                        "before it counts as hung and the server is restarted")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="server restarts after process faults allowed within --restart-window; one more and the "
                        "launcher exits 1 (0: exit at the first fault)")
    p.add_argument("--restart-window", type=float, default=600.0, help="seconds (see --max-restarts)")
    p.add_argument("--health-port", type=int, default=0,
                   help="the launcher's own probes: GET /live (200 while it serves or heals) and /ready "
                        "(200 when Triton's llm is ready); 0 = off")
    p.add_argument("--render-only", action="store_true", help="render the repository and exit")
    p.add_argument("triton_args", nargs="*", help="extra tritonserver arguments, after `--`")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = lora_params(parse_params(args.param), args.lora)
        if args.allow_runtime_lora:
            params["lora_load_dir"] = str(Path(args.allow_runtime_lora).resolve())
        args.instances, params, plan = resolve_instances(args.instances, params)
        if plan:
            print(f"splitfuse.launcher: {describe(plan)}", file=sys.stderr, flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options_error = _options_error(args, params)
    if options_error:
        print(f"error: {options_error}", file=sys.stderr)
        return 2
    try:
        admin_key = _admin_key(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="splitfuse-serve-"))
    repo_dir = Path(args.model_repository_out) if args.model_repository_out else work / "model_repository"
    try:
        install = find_tritonserver(args.triton_root)
        model = prepare_checkpoint(args.model)
        if is_random_demo(model):
            print(f"splitfuse.launcher: WARNING: {RANDOM_WARNING}", file=sys.stderr, flush=True)
        repo = render_model_repository(
            repo_dir, model, params, instances=args.instances,
            preprocessing_instances=args.preprocessing_instances, template_dir=args.model_repository_template,
            name_prefix=args.model_name_prefix,
        )
        if args.render_only:
            print(f"rendered model repository: {repo}")
            return 0
        ready_timeout = _ready_timeout(args, model, params)
        backend_dir = build_backend_dir(work / "backends", install)
        server = TritonServer(
            model_repository=repo, backend_dir=backend_dir, http_port=args.http_port, grpc_port=args.grpc_port,
            metrics_port=args.metrics_port, host=args.host, inference_host=args.triton_host, install=install,
            log_file=None,
            control_dir=work / "control", llm_instances=args.instances, drain_timeout_s=args.drain_timeout,
            exit_timeout_s=args.exit_timeout, log_verbose=args.log_verbose, extra_args=args.triton_args,
            admin_key=admin_key, restrict_admin_apis=not args.open_admin_apis,
        )
        front = None
        if args.openai_port:
            front = OpenAIFront(model, server.grpc_url, args.host, args.openai_port, params,
                                triton_model=args.model_name_prefix + LLM_MODEL,
                                triton_http_url=server.http_url if args.triton_proxy else None,
                                served_model_name=args.served_model_name,
                                max_logprob_entries=args.max_logprob_entries,
                                allow_runtime_lora=bool(args.allow_runtime_lora))
        healing = Healing(Watchdog(server.control_dir, args.step_timeout),
                          RestartBudget(args.max_restarts, args.restart_window))
        # The front's restarts: bounded as the server's, in a budget of their own.
        front_watch = None if front is None else FrontWatch(front, RestartBudget(args.max_restarts,
                                                                                 args.restart_window))
        health = None
        if args.health_port:
            health = HealthServer(args.host, args.health_port,
                                  ready=lambda: (server.running() and server.is_ready()
                                                 and (front_watch is None or front_watch.up)),
                                  restarts=lambda: healing.restarts)
            health.start()
        try:
            return _run_foreground(server, ready_timeout, front, healing, front_watch)
        except StopNow:
            _kill_now(server, front)  # again: a restart under way may have started one since
            print("splitfuse.launcher: killed at the second signal", file=sys.stderr, flush=True)
            return 1
        finally:
            if health is not None:
                health.stop()
    except (ValueError, OSError, RuntimeError) as e:  # bad parameters, missing files, ports in use, no compiler
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ready_timeout(args: argparse.Namespace, model: str, params: dict) -> float:
    """--ready-timeout, or when it is not given the default for this checkpoint (startup_budget.py), logged."""
    if args.ready_timeout is not None:
        return args.ready_timeout
    seconds, nbytes = default_ready_timeout(model, params, args.instances)
    print(f"splitfuse.launcher: start-up budget {seconds:.0f}s: {READY_BASE_S:.0f}s + {READY_S_PER_GB:.0f}s/GB x "
          f"{nbytes / 1e9:.2f} GB x {args.instances} replica(s)", file=sys.stderr, flush=True)
    return seconds


def _options_error(args: argparse.Namespace, params: dict) -> str | None:
    """Why these options cannot go together (checked before anything starts)."""
    if args.render_only and not args.model_repository_out:
        return "--render-only needs --model-repository-out"
    if args.triton_proxy and not args.openai_port:
        return "--triton-proxy needs --openai-port (the front forwards it)"
    return _front_options_error(args, params)


def _admin_key(args: argparse.Namespace) -> str | None:
    """The admin key, its characters checked; also refuses --triton-proxy without an API key."""
    admin_key = key_from(args.admin_key_file, ADMIN_KEY_ENV)
    if admin_key is not None:
        hidden_args.check_secret(f"the admin key from {args.admin_key_file or '$' + ADMIN_KEY_ENV}", admin_key)
    if args.triton_proxy and key_from(None, API_KEY_ENV) is None:
        raise ValueError(f"--triton-proxy needs an API key (${API_KEY_ENV}): without one it would open "
                         "Triton's unauthenticated API on the front's port")
    return admin_key


@dataclass
class Healing:
    """How the launcher finds process faults and how often it may restart the server for them."""

    watchdog: Watchdog
    budget: RestartBudget
    restarts: int = 0
    failed_requests: int = 0
    last_recovery_s: float = 0.0

    def publish(self, server: TritonServer) -> None:
        write_faults(server.control_dir, restarts=self.restarts, failed_requests=self.failed_requests,
                     last_recovery_s=round(self.last_recovery_s, 3))

    def heal(self, server: TritonServer, fault: str, ready_timeout_s: float, stopping: list[int]) -> str | None:
        """Restart the server after `fault`; None once it is ready again, else why it gave up."""
        if not self.budget.take(time.monotonic()):
            return (f"{fault}; {self.restarts} restarts already within {self.budget.window_s:g}s "
                    f"(--max-restarts {self.budget.max_restarts}): giving up")
        self.restarts += 1
        self.failed_requests += self.watchdog.in_flight()
        print(f"splitfuse.launcher: {fault}; restarting tritonserver (restart {self.restarts}; requests in flight "
              "end with an error)", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            server.restart()
            self.watchdog.reset()
            self.publish(server)
            deadline = start + ready_timeout_s
            while not server.is_ready():
                if stopping:
                    return None  # Ctrl-C while restarting: the normal shutdown follows
                if not server.running() or time.monotonic() > deadline:
                    return f"{fault}; the restarted tritonserver did not get ready ({exit_description(server.process.returncode)})"
                time.sleep(0.1)
        except OSError as e:
            return f"{fault}; restarting failed: {e}"
        self.last_recovery_s = time.monotonic() - start
        self.publish(server)
        print(f"splitfuse.launcher: serving again {self.last_recovery_s:.1f}s after the fault", file=sys.stderr,
              flush=True)
        return None


class StopNow(Exception):
    """The second Ctrl-C/SIGTERM: raised in the signal handler, so it ends whatever the launcher
    was doing (a drain, a restart, waiting for ports) at once."""


def _front_options_error(args: argparse.Namespace, params: dict[str, str]) -> str | None:
    """What is wrong with the OpenAI front's options, checked before anything starts (else the
    front would refuse them only once Triton is up)."""
    given = [flag for flag, value in (("--served-model-name", args.served_model_name),
                                      ("--max-logprob-entries", args.max_logprob_entries)) if value is not None]
    if given and not args.openai_port:
        return f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --openai-port (options of the OpenAI front)"
    try:
        if args.served_model_name is not None:
            check_served_model_name(args.served_model_name)
            if args.served_model_name in resolve_lora_modules(params.get(LORA_MODULES, "")):
                return f"LoRA adapter name {args.served_model_name!r} is the served model's name"
    except ValueError as e:
        return str(e)
    if args.max_logprob_entries is not None and args.max_logprob_entries < 1:
        return f"--max-logprob-entries must be positive, got {args.max_logprob_entries}"
    return None


def _kill_now(server: TritonServer, front: OpenAIFront | None) -> None:
    server.kill()
    if front is not None:
        front.kill()


def _run_foreground(server: TritonServer, ready_timeout_s: float, front: OpenAIFront | None = None,
                    healing: Healing | None = None, front_watch: FrontWatch | None = None) -> int:
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)
        if len(signals) == 1:
            print(f"\nsplitfuse.launcher: {signal.Signals(signum).name}: stopping (in-flight generations get "
                  f"{server.drain_timeout_s:g}s to finish, then are aborted; signal again to kill now)",
                  file=sys.stderr, flush=True)
            return
        # A second Ctrl-C: no drain, no restart; every child killed, the launcher leaves now.
        _kill_now(server, front)
        if len(signals) == 2:
            raise StopNow()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not signals and not server.is_ready():
            if not server.running():
                print(f"splitfuse.launcher: tritonserver exited with code {server.process.returncode}",
                      file=sys.stderr)
                return server.process.returncode or 1
            if time.monotonic() > deadline:
                print(f"splitfuse.launcher: not ready after {ready_timeout_s:.0f}s, stopping", file=sys.stderr)
                signals.append(signal.SIGTERM)
                break
            time.sleep(0.25)
        if not signals and front is not None:
            front.start(read_limits(server.control_dir, front.triton_model).get("max_model_len"))
            if not front.wait_ready():
                print(f"splitfuse.launcher: the OpenAI front did not come up on {front.url}", file=sys.stderr)
                signals.append(signal.SIGTERM)
            elif front_watch is not None:
                front_watch.started()
        if not signals:
            print(_ready_banner(server, front), flush=True)
        gave_up = None
        if healing is not None and not signals:
            healing.publish(server)
        if not signals:
            gave_up = _serve(server, ready_timeout_s, healing, front_watch, signals)
    finally:
        # Also on an unexpected error here: never leave a tritonserver (or the front) behind.
        if len(signals) > 1:
            _kill_now(server, front)
        else:
            _shutdown(server, front)
    if gave_up is not None:
        # Nobody asked it to stop: a supervisor must restart the whole server.
        print(f"splitfuse.launcher: {gave_up}; the OpenAI front is stopped, exiting 1", file=sys.stderr, flush=True)
        return 1
    code = server.process.returncode
    print(f"splitfuse.launcher: tritonserver exited with code {code}", file=sys.stderr)
    if signals and code not in (0, -signal.SIGTERM) and server.drained:
        # Every generation had ended; Triton only failed to unload a model in time (2.51: a
        # client still holding a gRPC stream, or an ensemble stream dropped before its final flag).
        print("splitfuse.launcher: every generation had finished before shutdown; tritonserver could not "
              "unload a model in time (see README: known limitations)", file=sys.stderr)
        return 0
    return 0 if code in (0, -signal.SIGTERM) else 1


def _ready_banner(server: TritonServer, front: OpenAIFront | None) -> str:
    return (
        f"splitfuse.launcher: ready (Triton's HTTP and gRPC on {server.bind_inference}; metrics"
        f"{', OpenAI' if front else ''} and health on {server.host})\n"
        f"  HTTP    http://{server.http_url}  (POST /v2/models/ensemble/generate_stream)\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics {server.metrics_url}\n"
        + (f"  OpenAI  {front.url}/v1  (chat/completions, completions, models)\n" if front else "")
        + (f"  Triton  {front.url}/v2  (Triton's HTTP API through the front, behind its API key)\n"
           if front and front.triton_http_url else "")
        + f"  models  {server.model_repository}"
    )


def _serve(server: TritonServer, ready_timeout_s: float, healing: Healing | None, front_watch: FrontWatch | None,
           signals: list[int]) -> str | None:
    """Watches the children until a signal (None) or a fault that cannot be healed (why)."""
    while not signals:
        if front_watch is not None:  # Triton keeps serving while the front restarts
            gave_up = front_watch.poll()
            if gave_up is not None:
                return gave_up
        fault = None
        if not server.running():
            fault = f"tritonserver died while serving ({exit_description(server.process.returncode)})"
        elif healing is not None:
            fault = healing.watchdog.fault(server.process.pid)
        if fault is not None:
            gave_up = fault if healing is None else healing.heal(server, fault, ready_timeout_s, signals)
            if gave_up is not None:
                server.kill()  # a hung replica would hold up the drain: nothing is left to save
                return gave_up
        time.sleep(0.2)
    return None


def _shutdown(server: TritonServer, front: OpenAIFront | None) -> None:
    """Triton's drain before the front stops: the front's clients then get their generations'
    last events (finish_reason, `data: [DONE]`) through it, and new requests a 503 from it (llm
    refuses them while draining). Stopping the front first cut its open streams short."""
    drained = False
    if front is not None and front.running() and server.running():
        server.drain(server.drain_timeout_s)
        server.abort_in_flight()  # what is left ends with finish_reason "abort"
        drained = True
    if front is not None:
        front.stop()  # uvicorn's graceful shutdown: the answers under way are sent in full
    if server.running():
        # After the drain above nothing is left to wait for: SIGTERM (and a kill if Triton hangs).
        server.stop(drain_timeout_s=0 if drained else None)
