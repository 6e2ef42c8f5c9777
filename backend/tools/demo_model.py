"""Build small random-weight Hugging Face checkpoints locally (no network).

Used by `make serve` (the demo model), the tests and the benchmarks:

    python -m splitfuse.tools.demo_model OUT_DIR --arch llama --size tiny

A byte-level BPE tokenizer is trained with `tokenizers` on built-in text that mixes
English, CJK and emoji, so multi-byte characters get split across tokens; or, with
`--tokenizer sentencepiece`, one in Llama 2's layout (``▁`` word pieces, byte fallback, a
decoder that strips a leading space).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "mixtral")
TOKENIZERS = ("byte_level", "sentencepiece")

# Per-architecture config defaults on top of a size (overrides still win): a tiny MoE
# with 4 experts and top-2 routing, so some experts get no tokens in small batches.
ARCH_DEFAULTS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}

# Model shapes. "tiny" keeps tests fast; "bench" is the ~30M-parameter CPU benchmark
# model (hidden 512, 8 layers) on which prefill is compute-bound and decode memory-bound.
# "medium" (~140M parameters, ~5.6x bench's compute per token) shows how the serving path's
# fixed cost per streamed token weighs once the model is less of a toy.
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "bench": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                   num_attention_heads=16, num_key_value_heads=8, vocab_size=8192),
}

_WORDS = (
    "the quick brown fox jumps over a lazy dog while servers stream tokens to many clients "
    "attention cache block table scheduler budget prompt decode chunk kernel triton inference "
    "model request response latency throughput memory paged split fuse batch sequence token "
    "hello world please write a story about the sea and the mountains under a bright sky"
).split()
_CJK = "你好世界今天天气很好我们一起学习语言模型日本語のテキストを生成します한국어 문장도 있습니다"
_EMOJI = "😀🚀🌍🔥✨🎉🤖📚🍣🐍"


def _corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.75:
                parts.append(rng.choice(_WORDS))
            elif r < 0.9:
                start = rng.randrange(len(_CJK) - 4)
                parts.append(_CJK[start : start + rng.randint(1, 4)])
            else:
                parts.append(rng.choice(_EMOJI))
        out.append(" ".join(parts) + rng.choice([".", "!", "?", ","]))
    return out


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int, seed: int = 0):
    """Train a byte-level BPE tokenizer and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_sentencepiece_tokenizer(out_dir: str | os.PathLike, vocab_size: int):
    """A tokenizer in Llama 2's layout (sentencepiece, as transformers converts it): word pieces
    with ``\u2581`` for a leading space, a piece for every byte (byte fallback: CJK and emoji come
    out as their UTF-8 bytes), and a decoder that strips the leading space of whatever it
    decodes. Padded with more word pieces to `vocab_size` ids where that is larger."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    space = "\u2581"
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces.append((space, -5.0))
    words = list(dict.fromkeys(_WORDS)) + ["\u4f60\u597d", "\u4e16\u754c"]  # two CJK words as pieces too
    while len(pieces) + 2 * len(words) < vocab_size:
        words.append(f"w{len(words)}")
    pieces += [(p, -2.0) for w in words for p in (w, space + w)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "byte_level",
    init_device: str = "cpu",
    **overrides,
) -> Path:
    """Write a random-weight checkpoint + tokenizer (`TOKENIZERS`) to `out_dir` and return the path.

    `overrides` go into the transformers config (e.g. tie_word_embeddings=True,
    rope_parameters={...}, sliding_window=...). `init_device`: where the weights are drawn
    ("cuda" draws an 8B-shaped model in seconds where the CPU takes minutes).
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(SIZES[size])
    shape.update(ARCH_DEFAULTS.get(arch, {}))
    shape.update(overrides)
    if tokenizer == "sentencepiece":
        tok = build_sentencepiece_tokenizer(out, shape["vocab_size"])
    else:
        tok = build_tokenizer(out, shape["vocab_size"], seed)
    shape["vocab_size"] = len(tok)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "mixtral": transformers.MixtralConfig,
    }[arch]
    # A wider init than the default 0.02 keeps random logits peaked, so greedy argmax is
    # decided by clear margins rather than by float rounding.
    shape.setdefault("initializer_range", 0.1)
    shape.setdefault("max_position_embeddings", 4096)
    config = config_cls(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
    }[arch]
    with torch.device(init_device):
        model = model_cls(config).to(getattr(torch, dtype)).eval()
    if arch == "qwen2":
        # Random non-zero q/k/v biases so the bias path is really exercised.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    # Record what built it, for benchmark reports.
    (out / "splitfuse_demo.json").write_text(json.dumps({"arch": arch, "size": size, "seed": seed,
                                                          "tokenizer": tokenizer}))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=ARCHS)
    parser.add_argument("--size", default="tiny", choices=tuple(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="byte_level", choices=TOKENIZERS)
    args = parser.parse_args(argv)
    path = build_model(args.out_dir, args.arch, args.size, args.seed, tokenizer=args.tokenizer)
    print(f"wrote {args.arch}/{args.size} checkpoint to {path}")


if __name__ == "__main__":
    main()
