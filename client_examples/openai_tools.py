"""Tool calling through the OpenAI-compatible front with the official `openai` SDK: the model
calls a function, this script runs it and sends the result back, the model answers.

    python client_examples/openai_tools.py --base-url http://127.0.0.1:9000/v1 "Weather in Paris?"

--tool-choice required (the default here) constrains the first answer to a call of one of the
tools, with arguments valid for its parameters schema; auto lets the model choose (a small model
often answers in text instead). The key is $SPLITFUSE_API_KEY when the server asks for one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}]


def get_weather(city: str, days: int) -> str:
    """Stands in for a real weather service."""
    return json.dumps({"city": city, "forecast": ["sunny"] * days})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("question", nargs="?", default="What is the weather in Paris for the next two days?")
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    p.add_argument("--tool-choice", choices=["auto", "required"], default="required")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("SPLITFUSE_API_KEY", "unused"), max_retries=2)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "user", "content": args.question}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=args.tool_choice,
                                           max_tokens=args.max_tokens, temperature=0)
    message = first.choices[0].message
    if not message.tool_calls:
        print(f"[no tool call, finish: {first.choices[0].finish_reason}]\n{message.content}")
        return 0
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        print(f"[call {call.function.name}({arguments})]", file=sys.stderr)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**arguments)})
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=args.max_tokens, temperature=0)
    print(answer.choices[0].message.content)
    print(f"[finish: {answer.choices[0].finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
