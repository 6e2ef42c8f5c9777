"""The FastGen benchmark's workload: request lengths from seeded normals, prose prompts cut to them.

Prompt and generation lengths are drawn from normal distributions whose standard deviation is
30% of the mean (the DeepSpeed-FastGen blog's "30% variance"); the blog used prompt means
1200/2600 and generation means 60/128 on A100/H100 GPUs. The request list is drawn once from a
seed, so every system sees the same requests in the same order.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.common.paths import CACHE

VARIANCE = 0.3
BLOG_PROMPT_MEANS = (1200, 2600)
BLOG_GEN_MEANS = (60, 128)

# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------
# Prompt source text (written for this benchmark): ordinary prose on assorted subjects, so
# prompts look like user requests rather than repeated tokens. Each prompt starts at a random
# sentence, and opens with its request number, so no two prompts share even their first KV block:
# no system gets a prefix-cache advantage whatever its caching setting.
_PASSAGES = [
    "Please summarise the following notes from our weekly planning meeting.",
    "The harbour town wakes early; fishing boats leave before dawn and return by noon with the catch.",
    "Our team moved the billing service to a new database last spring, and latency dropped by a third.",
    "Explain in simple words why the sky looks blue during the day and red at sunset.",
    "A good sourdough starter needs flour, water, patience and a warm corner of the kitchen.",
    "The museum opened a new wing dedicated to maps drawn by sailors in the sixteenth century.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "When the river flooded, volunteers filled sandbags through the night to protect the school.",
    "The committee reviewed three proposals for the park and chose the one with the most trees.",
    "Compare the advantages of trains and aeroplanes for a journey of about five hundred kilometres.",
    "Her grandfather kept bees on the hillside and sold honey at the Saturday market.",
    "Translate the menu into plain English so that visitors can order without help.",
    "The spacecraft will reach the outer planets in nine years if the launch window holds.",
    "List the steps needed to replace a flat bicycle tyre on the side of a mountain road.",
    "Scientists measured the temperature of the lake every hour for an entire year.",
    "The orchestra rehearsed the final movement until the conductor was finally satisfied.",
    "Describe a quiet morning in a mountain village after the first snow of winter.",
    "Customers asked for a dark mode, faster search and an easier way to export their data.",
    "The old bridge was closed for repairs, so traffic was diverted through the city centre.",
    "Give three reasons why regular sleep matters for memory and concentration.",
    "In the garden the tomatoes ripened late, but the beans grew faster than anyone expected.",
    "The library extended its opening hours during exam season to help students study.",
    "Draft a polite email asking a supplier to confirm the delivery date of our order.",
    "Astronomers spotted a comet that will be visible to the naked eye next month.",
    "The chef explained that fresh herbs should be added at the very end of cooking.",
    "Write a haiku about the sound of rain on a tin roof in late summer.",
    "The city council approved new bicycle lanes along the river and near the station.",
    "Engineers tested the robot arm by asking it to stack cups of different sizes.",
    "Outline a lesson plan that introduces fractions to children aged nine and ten.",
    "The travellers crossed the desert at night, guided by the stars and an old compass.",
]


@dataclass
class RequestSpec:
    """One request of the workload; identical for every system under test."""

    idx: int
    prompt: str
    prompt_tokens: int
    """Prompt length in tokens as the checkpoint's tokenizer counts it (with special tokens)."""
    gen_tokens: int
    """Number of tokens to generate (exactly: ignore_eos / min_tokens)."""


def draw_lengths(n: int, mean: float, variance: float, lo: int, hi: int, rng: random.Random) -> list[int]:
    """n integer lengths ~ Normal(mean, variance*mean), rounded and clipped to [lo, hi]."""
    return [min(hi, max(lo, int(round(rng.gauss(mean, variance * mean))))) for _ in range(n)]


def _text_source(rng: random.Random, approx_chars: int) -> str:
    start = rng.randrange(len(_PASSAGES))
    parts: list[str] = []
    size = 0
    i = start
    while size < approx_chars:
        s = _PASSAGES[i % len(_PASSAGES)]
        parts.append(s)
        size += len(s) + 1
        i += 1 + (rng.random() < 0.3)  # skip now and then so sentence order varies
    return " ".join(parts)


def make_prompt(tokenizer: Any, n_tokens: int, rng: random.Random, tag: str = "") -> tuple[str, int]:
    """`tag`, then prose, whose tokenization (with special tokens) has about `n_tokens` tokens.

    Returns (text, exact token count of the text as the tokenizer encodes it).
    """
    special = len(tokenizer("").input_ids)  # BOS etc. added by the server's tokenizer too
    want = max(1, n_tokens - special)
    text = tag + _text_source(rng, approx_chars=want * 6 + 64)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < want:  # very dense tokenizers: grow
        text += " " + _text_source(rng, approx_chars=want * 6)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    text = tokenizer.decode(ids[:want])
    # Decoding a byte-level prefix and re-encoding can shift the count by a token or two.
    for _ in range(4):
        count = len(tokenizer(text, add_special_tokens=False).input_ids)
        if count <= want:
            break
        ids2 = tokenizer(text, add_special_tokens=False).input_ids[: want - (count - want)]
        text = tokenizer.decode(ids2)
    return text, len(tokenizer(text).input_ids)


def make_workload(
    model_dir: str,
    num_requests: int,
    prompt_mean: float,
    gen_mean: float,
    variance: float = VARIANCE,
    seed: int = 0,
    max_model_len: int | None = None,
    min_prompt: int = 8,
    min_gen: int = 2,
) -> list[RequestSpec]:
    """The request list: lengths from the seeded normals, prompts built to those lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if max_model_len is None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        max_model_len = int(cfg.get("max_position_embeddings", 4096))
    rng = random.Random(seed)
    gens = draw_lengths(num_requests, gen_mean, variance, min_gen, max_model_len // 4, rng)
    prompts = draw_lengths(num_requests, prompt_mean, variance, min_prompt, max_model_len, rng)
    specs = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        p = min(p, max_model_len - g - 4)
        text, count = make_prompt(tokenizer, p, rng, tag=f"[{i}] ")
        specs.append(RequestSpec(idx=i, prompt=text, prompt_tokens=count, gen_tokens=g))
    return specs


def model_info(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                               cfg["vocab_size"])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = layers * per_layer + (1 if tied else 2) * vocab * h + h  # embeddings (+ lm_head) + final norm
    demo = gguf = {}
    if (Path(model_dir) / "splitfuse_demo.json").is_file():
        demo = json.loads((Path(model_dir) / "splitfuse_demo.json").read_text())
    if (Path(model_dir) / "splitfuse_gguf.json").is_file():  # converted by splitfuse.models.gguf_checkpoint
        gguf = json.loads((Path(model_dir) / "splitfuse_gguf.json").read_text())
    return {
        "path": str(model_dir),
        "arch": cfg.get("model_type"),
        "params_m": round(params / 1e6, 1),
        "hidden": h,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "intermediate": inter,
        "vocab": vocab,
        "dtype": cfg.get("dtype", cfg.get("torch_dtype")),
        "built_by": demo,
        "converted_from": gguf.get("source"),
    }


def random_id_requests(model_dir: str, n: int, prompt_mean: float, gen_mean: float, seed: int) -> list[dict]:
    """The offline benchmarks' requests: {"prompt": token ids, "max_tokens": n} with lengths drawn
    like the served workload's, and random ids above the few special tokens, so that no two
    prompts share a prefix (no text, no tokenizer)."""
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    prompts = draw_lengths(n, prompt_mean, VARIANCE, 8, 1800, rng)
    gens = draw_lengths(n, gen_mean, VARIANCE, 2, 200, rng)
    return [{"prompt": [rng.randrange(4, vocab) for _ in range(p)], "max_tokens": g} for p, g in zip(prompts, gens)]


SERVED_MAX_MODEL_LEN = 2048
"""The length cap perf/served/served_cpu_split.py draws its workload under (and so its engine-alone shares)."""


def served_id_requests(model_dir: str, n: int, prompt_mean: float, gen_mean: float, seed: int, part: int,
                       parts: int, max_model_len: int = SERVED_MAX_MODEL_LEN) -> list[dict]:
    """A served run's requests (make_workload: the same `n`, means, seed and length cap) as
    {"prompt": token ids, "max_tokens": n}, tokenized as the server does, every `parts`-th from
    `part`: the engine alone is measured on exactly the work the served run did (the random-id
    requests of another seed differ from it by a few per cent in prompt tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    specs = make_workload(model_dir, n, prompt_mean, gen_mean, VARIANCE, seed, max_model_len)[part::parts]
    return [{"prompt": tokenizer(s.prompt).input_ids, "max_tokens": s.gen_tokens} for s in specs]


BENCH_MODEL_DIR = CACHE / "bench-llama"


def add_workload_args(ap: Any, num_requests: int, prompt_mean: float, gen_mean: float) -> None:
    """The offline benchmarks' workload options (an argparse parser): the checkpoint, how many
    requests, their length means and the seed they are drawn from."""
    ap.add_argument("--model-dir", default=str(BENCH_MODEL_DIR))
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--prompt-mean", type=float, default=prompt_mean)
    ap.add_argument("--gen-mean", type=float, default=gen_mean)
    ap.add_argument("--seed", type=int, default=0)


def ensure_model(model_dir: str, size: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        print(f"[workload] building the {size} checkpoint in {model_dir}")
        subprocess.run([sys.executable, "-m", "splitfuse.tools.demo_model", model_dir, "--arch", "llama",
                        "--size", size], check=True)
