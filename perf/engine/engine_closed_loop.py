"""The engine's closed-loop throughput with clients that cost nothing: the ceiling of a served run.

    .venv/bin/python perf/engine/engine_closed_loop.py --clients 32 --num-requests 192 --param dtype=bfloat16

N clients run the FastGen workload (`workload.random_id_requests`: prompts ~N(512, 30%),
generations ~N(64, 30%), random token ids; greedy, ignore_eos) against an `EngineLoop` in this
process. A client's next request is submitted from the callback that receives its previous one's
final output, so no client thread takes CPU from the engine (run_all.py's in-process `engine` systems
time every token on client threads; a served run adds tritonserver, the stub's delivery and a
client process). Reported: requests per second from the first submit to the last final output, and
the engine's steps split into decode-only ones and ones with prompt tokens. Written to
perf/results/2026-11-26-engine-closed-loop/<name>.json with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common import paths  # noqa: E402
from perf.common.helpers import name_values  # noqa: E402
from perf.common.result_file import write_result  # noqa: E402
from perf.common.workload import add_workload_args, ensure_model, random_id_requests, served_id_requests  # noqa: E402

from splitfuse.config import split_parameters  # noqa: E402
from splitfuse.engine.loop import EngineLoop  # noqa: E402
from splitfuse.engine.sequence import SamplingParams  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-26-engine-closed-loop"


def run(model_dir: str, params: dict[str, str], clients: int, requests: list[dict], timeout_s: float = 1800.0) -> dict:
    config, server = split_parameters({"model": model_dir, **params})
    steps: list = []
    loop = EngineLoop(config, on_step=steps.append, server=server)
    loop.start()
    num_requests = len(requests)

    lock = threading.Lock()
    state = {"next": 0, "finished": 0, "last_end": 0.0}
    all_done = threading.Event()

    def submit() -> None:
        with lock:
            i = state["next"]
            if i >= len(requests):
                return
            state["next"] = i + 1
        r = requests[i]
        loop.submit(f"r{i}", r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True),
                    on_output)

    def on_output(out) -> None:
        if not out.finished:
            return
        with lock:
            state["finished"] += 1
            state["last_end"] = time.perf_counter()
            done = state["finished"] == len(requests)
        if done:
            all_done.set()
        else:
            submit()

    warm = threading.Event()
    loop.submit("warmup", [5] * 16, SamplingParams(max_tokens=4, temperature=0.0), lambda o: o.finished and warm.set())
    warm.wait()
    time.sleep(0.1)  # the warm-up's last step reports after its output went out
    steps.clear()
    start = time.perf_counter()
    for _ in range(clients):
        submit()
    if not all_done.wait(timeout_s):
        loop.shutdown()
        raise TimeoutError(f"{state['finished']} of {num_requests} requests finished in {timeout_s} s")
    wall = state["last_end"] - start
    loop.shutdown()

    def summary(kind: list) -> dict:
        total = sum(s.duration_s for s in kind)
        return {"steps": len(kind), "seconds": round(total, 3),
                "mean_step_ms": round(1e3 * total / len(kind), 3) if kind else None,
                "mean_tokens": round(sum(s.num_tokens for s in kind) / len(kind), 1) if kind else None}

    busy = sum(s.duration_s for s in steps)
    return {
        "requests_per_s": round(num_requests / wall, 3),
        "wall_s": round(wall, 3),
        "decode_only_steps": summary([s for s in steps if s.num_prompt_tokens == 0]),
        "steps_with_prompt_tokens": summary([s for s in steps if s.num_prompt_tokens > 0]),
        "forward_share_of_step_time": round(sum(s.forward_s for s in steps) / busy, 4) if busy else None,
        "prompt_tokens_computed": sum(s.num_prompt_tokens for s in steps),
        "tokens_generated": sum(s.num_generated_tokens for s in steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, num_requests=192, prompt_mean=512, gen_mean=64)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine parameter (defaults here: token_budget=256, enable_prefix_caching=false)")
    ap.add_argument("--served-share", metavar="K/N",
                    help="the requests of a served run (perf/served/served_cpu_split.py with the same "
                         "--num-requests, means and --seed: text prompts tokenized as the server does), every "
                         "N-th from the K-th (0-based): N engines at once, one share each, do that run's work; "
                         "without it, random token ids")
    ap.add_argument("--name", default="closed-loop")
    args = ap.parse_args()
    ensure_model(args.model_dir, "bench")
    params = {"token_budget": "256", "enable_prefix_caching": "false", **name_values(args.param)}
    if args.served_share:
        part, parts = (int(v) for v in args.served_share.split("/"))
        requests = served_id_requests(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.seed,
                                      part, parts)
    else:
        requests = random_id_requests(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.seed)
    result = run(args.model_dir, params, args.clients, requests)
    result.update({"params": params, "clients": args.clients, "num_requests": len(requests),
                   "served_share": args.served_share, "seed": args.seed})
    print(json.dumps({k: result[k] for k in ("requests_per_s", "decode_only_steps", "steps_with_prompt_tokens",
                                             "forward_share_of_step_time")}, indent=1))
    write_result(RESULTS, args.name, result)


if __name__ == "__main__":
    main()
