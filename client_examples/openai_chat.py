"""Chat through the OpenAI-compatible front with the official `openai` SDK, streamed.

    python client_examples/openai_chat.py --base-url http://127.0.0.1:9000/v1 "What is the capital of France?"

The model name is whatever the front serves (GET /v1/models); the key is $SPLITFUSE_API_KEY when
the server asks for one (any string otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("SPLITFUSE_API_KEY", "unused"), max_retries=2)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.question}], max_tokens=args.max_tokens,
        temperature=args.temperature, stream=True, stream_options={"include_usage": True})
    finish, usage = "", None
    for chunk in stream:
        if chunk.choices:
            sys.stdout.write(chunk.choices[0].delta.content or "")
            sys.stdout.flush()
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = f", {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else ""
    print(f"\n[model {model}, finish: {finish}{tokens}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
