"""The same prompt through the base model and each LoRA adapter the server serves, with the
official `openai` SDK: an adapter is a model of its own (`model=<adapter name>`).

    python -m splitfuse.launcher --model DIR --lora sql=/path/to/peft_folder --openai-port 9000
    python client_examples/openai_lora.py --base-url http://127.0.0.1:9000/v1 "SELECT"

GET /v1/models lists the base model first, then the adapters, each with its base as `parent`.
Over Triton directly, the `lora_name` input picks the adapter (`llm` and `ensemble`).
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="The capital of France is")
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("SPLITFUSE_API_KEY", "unused"), max_retries=2)
    for card in client.models.list().data:
        parent = card.to_dict().get("parent")  # a vLLM-style field, not in the SDK's Model type
        answer = client.completions.create(model=card.id, prompt=args.prompt, max_tokens=args.max_tokens,
                                           temperature=0)
        label = f"{card.id} (LoRA over {parent})" if parent else f"{card.id} (base)"
        print(f"{label}: {answer.choices[0].text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
