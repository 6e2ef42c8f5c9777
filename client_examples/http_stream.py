"""Stream a generation over HTTP (Triton's generate_stream: server-sent events), stdlib only.

    python client_examples/http_stream.py --prompt "hello world" --max-tokens 64
    python client_examples/http_stream.py --no-stream          # POST .../generate: one JSON answer
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--prompt", default="hello world")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true")
    args = p.parse_args()

    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": not args.no_stream}
    endpoint = "generate" if args.no_stream else "generate_stream"
    req = urllib.request.Request(f"http://{args.url}/v2/models/{args.model}/{endpoint}",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            if args.no_stream:
                out = json.loads(resp.read())
                print(out["text_output"])
                print(f"[finish: {out['finish_reason']}]", file=sys.stderr)
                return 0
            finish = ""
            for raw in resp:  # one "data: {json}" line per response
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    print(f"\nerror: {event['error']}", file=sys.stderr)
                    return 1
                sys.stdout.write(event["text_output"])
                sys.stdout.flush()
                finish = event.get("finish_reason") or finish
            print(f"\n[finish: {finish}]", file=sys.stderr)
            return 0
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
