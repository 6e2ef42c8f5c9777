#!/usr/bin/env bash
# The HTTP generate endpoints with curl. Usage: client_examples/curl.sh [host:port]
set -euo pipefail
URL=${1:-localhost:8000}

# One JSON answer with the whole text (stream=false).
curl -sS -X POST "http://$URL/v2/models/ensemble/generate" \
  -d '{"text_input": "hello world", "max_tokens": 32, "temperature": 0.0}'
echo

# Server-sent events, one per engine step: data: {"text_output": "<delta>", ...}
curl -sS -N -X POST "http://$URL/v2/models/ensemble/generate_stream" \
  -d '{"text_input": "hello world", "max_tokens": 32, "temperature": 0.0, "stream": true,
       "return_num_output_tokens": true}'
echo

# Straight to the llm model (cancellation reaches it; see README): sampling with a seed.
curl -sS -X POST "http://$URL/v2/models/llm/generate" \
  -d '{"text_input": "hello world", "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 7}'
echo
