"""Benchmark clients that stream one request and time every token of it.

Triton: tritonclient gRPC streaming against our `ensemble` or `llm` model (TensorRT-LLM tensor
names), or Triton's HTTP generate extension (server-sent events, read like vLLM's). OpenAI:
streaming /v1/completions against any OpenAI-compatible server (e.g. vLLM).
Engine: our engine in this process (`EngineLoop`, no server, no transport), the "offline"
reference that says what serving costs.
"""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Sequence

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.served.fastgen_metrics import RequestRecord
from perf.common.workload import RequestSpec


def grpc_inputs(values: dict[str, tuple[Any, str]]) -> list:
    """tritonclient gRPC inputs from {name: (numpy array, Triton datatype)}."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (arr, dtype) in values.items():
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


class Driver:
    name = "driver"

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TritonDriver(Driver):
    """Streams one request at a time over tritonclient gRPC (one stream per client thread).

    Token counting per streamed response: the length of `output_ids` when the model returns it,
    else the increase of `num_output_tokens`, else one token per non-empty `text_output`.
    """

    name = "triton"

    def __init__(self, url: str, model: str = "ensemble", temperature: float = 0.0,
                 lora_names: Sequence[str | None] | None = None):
        """`lora_names`: request i names adapter lora_names[i % len] (None: the base model)."""
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url = url
        self.model = model
        self.temperature = temperature
        self.lora_names = list(lora_names or [])
        probe = grpcclient.InferenceServerClient(url)
        meta = probe.get_model_metadata(model, as_json=True)
        probe.close()
        self.input_names = {i["name"]: i["datatype"] for i in meta.get("inputs", [])}
        self.output_names = [o["name"] for o in meta.get("outputs", [])]
        if any(n is not None for n in self.lora_names) and "lora_name" not in self.input_names:
            raise ValueError(f"model {model!r} has no lora_name input")
        self._local = threading.local()

    def _client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._grpc.InferenceServerClient(self.url)
            self._local.client = c
        return c

    def _inputs(self, spec: RequestSpec) -> list:
        import numpy as np

        values: dict[str, tuple[Any, str]] = {
            "text_input": (np.array([[spec.prompt.encode("utf-8")]], dtype=object), "BYTES"),
            "max_tokens": (np.array([[spec.gen_tokens]], dtype=np.int32), "INT32"),
            "stream": (np.array([[True]], dtype=bool), "BOOL"),
            "ignore_eos": (np.array([[True]], dtype=bool), "BOOL"),
            "min_tokens": (np.array([[spec.gen_tokens]], dtype=np.int32), "INT32"),
            "temperature": (np.array([[self.temperature]], dtype=np.float32), "FP32"),
            "exclude_input_in_output": (np.array([[True]], dtype=bool), "BOOL"),
            "return_num_input_tokens": (np.array([[True]], dtype=bool), "BOOL"),
            "return_num_output_tokens": (np.array([[True]], dtype=bool), "BOOL"),
        }
        lora_name = self.lora_names[spec.idx % len(self.lora_names)] if self.lora_names else None
        if lora_name is not None:
            values["lora_name"] = (np.array([[lora_name.encode("utf-8")]], dtype=object), "BYTES")
        declared: dict[str, tuple[Any, str]] = {}
        for name, (arr, dtype) in values.items():
            if name not in self.input_names:
                continue
            want = self.input_names[name]
            if want != dtype:  # follow the model's declared type (e.g. INT64 max_tokens)
                np_type = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP16": np.float16,
                           "BOOL": bool, "UINT64": np.uint64}.get(want)
                if np_type is None:
                    continue
                arr = arr.astype(np_type)
                dtype = want
            declared[name] = (arr, dtype)
        return grpc_inputs(declared)

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        c = self._client()
        events: queue.Queue = queue.Queue()

        def callback(result=None, error=None):
            events.put((time.perf_counter(), result, error))

        inputs = self._inputs(spec)
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=0.0)
        c.start_stream(callback=callback)
        try:
            rec.start = time.perf_counter()
            c.async_stream_infer(self.model, inputs, request_id=f"{spec.idx}-{client}",
                                 enable_empty_final_response=True)
            deadline = rec.start + timeout
            last_num_out = 0
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    rec.error = "timeout"
                    break
                try:
                    t, result, error = events.get(timeout=remaining)
                except queue.Empty:
                    rec.error = "timeout"
                    break
                if error is not None:
                    rec.error = str(error)
                    break
                n = 0
                got_count = False
                ids = result.as_numpy("output_ids") if "output_ids" in self.output_names else None
                if ids is not None:
                    n = int(ids.size)
                    got_count = True
                num_out = (result.as_numpy("num_output_tokens")
                           if "num_output_tokens" in self.output_names else None)
                if num_out is not None and num_out.size:
                    total = int(num_out.reshape(-1)[0])
                    if not got_count:
                        n = max(0, total - last_num_out)
                        got_count = True
                    last_num_out = max(last_num_out, total)
                    rec.server_output_tokens = total
                if not got_count:
                    text = result.as_numpy("text_output") if "text_output" in self.output_names else None
                    n = 1 if text is not None and text.size and len(text.reshape(-1)[0]) else 0
                num_in = (result.as_numpy("num_input_tokens")
                          if "num_input_tokens" in self.output_names else None)
                if num_in is not None and num_in.size:
                    rec.server_prompt_tokens = int(num_in.reshape(-1)[0])
                if n:
                    rec.chunks.append((t, n))
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    rec.end = t
                    break
        finally:
            if not rec.end:
                rec.end = time.perf_counter()
            c.stop_stream(cancel_requests=rec.error is not None)
        return rec

    def close(self) -> None:
        pass


def stream_sse(host: str, port: int, path: str, body: dict, rec: RequestRecord, timeout: float,
                on_event: Callable[[dict, float], None], done_marker: bytes | None) -> None:
    """POST `body` as JSON and read the server-sent events of the answer, calling
    `on_event(message, arrival time)` for each; `rec.error` / `rec.end` say how it ended: at
    `done_marker` (OpenAI's `[DONE]`), or at the end of the stream when None (Triton)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        rec.start = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return
        deadline = rec.start + timeout
        while True:
            line = resp.readline()
            t = time.perf_counter()
            if not line:
                if done_marker is None:
                    rec.end = t
                break
            if t > deadline:
                rec.error = "timeout"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == done_marker:
                rec.end = t
                break
            msg = json.loads(payload)
            if "error" in msg:
                rec.error = str(msg["error"])[:300]
                break
            on_event(msg, t)
        if rec.error is None and not rec.end:
            rec.error = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not rec.end:
            rec.end = time.perf_counter()
        conn.close()


def _scalar(value: Any) -> Any:
    """A one-element output of Triton's generate extension: JSON gives it as a value or a list."""
    return (value[0] if value else None) if isinstance(value, list) else value


def _split_url(url: str) -> tuple[str, int, str]:
    u = urllib.parse.urlparse(url if "://" in url else "http://" + url)
    return u.hostname or "127.0.0.1", u.port or 80, u.path.rstrip("/")


class TritonHttpDriver(Driver):
    """Streams one request over Triton's HTTP generate extension
    (`POST /v2/models/<model>/generate_stream`, server-sent events), read the way the OpenAI
    driver reads vLLM's stream: a plain HTTP connection per request, no client threads.

    Tokens per event: the length of `output_ids` (a number when the step made one token), else
    the increase of `num_output_tokens`, else one per non-empty `text_output`. The stream ends
    with the final response; when the model returns `finish_reason`, a stream that closes before
    one is non-empty is an error.
    """

    name = "triton-http"

    def __init__(self, url: str, model: str = "ensemble", temperature: float = 0.0):
        self.host, self.port, self.base = _split_url(url)
        self.model = model
        self.temperature = temperature

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        body = {"text_input": spec.prompt, "max_tokens": spec.gen_tokens, "min_tokens": spec.gen_tokens,
                "stream": True, "ignore_eos": True, "temperature": self.temperature,
                "exclude_input_in_output": True, "return_num_input_tokens": True,
                "return_num_output_tokens": True}
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=0.0)
        last = [0]
        finish: list[str | None] = [None]  # stays None for models without a finish_reason output

        def on_event(msg: dict, t: float) -> None:
            if "finish_reason" in msg:
                finish[0] = _scalar(msg["finish_reason"]) or ""
            ids = msg.get("output_ids")
            n = None if ids is None else (len(ids) if isinstance(ids, list) else 1)
            total = msg.get("num_output_tokens")
            if total is not None:
                total = int(_scalar(total))
                if n is None:
                    n = max(0, total - last[0])
                last[0] = max(last[0], total)
                rec.server_output_tokens = total
            num_in = msg.get("num_input_tokens")
            if num_in is not None:
                rec.server_prompt_tokens = int(_scalar(num_in))
            if n is None:
                n = 1 if msg.get("text_output") else 0
            if n:
                rec.chunks.append((t, n))

        stream_sse(self.host, self.port, f"{self.base}/v2/models/{self.model}/generate_stream", body, rec,
                    timeout, on_event, done_marker=None)
        if rec.error is None and finish[0] == "":  # the stream closed before the final response
            rec.error = "stream ended without a finish_reason"
        return rec


class OpenAIDriver(Driver):
    """Streaming /v1/completions against an OpenAI-compatible server (vLLM, llama-server).

    Tokens per SSE chunk: `choices[0].token_ids` when the server returns them (vLLM with
    `return_token_ids`), else the increase of `usage.completion_tokens` (continuous usage stats),
    else one per non-empty text chunk.
    """

    name = "openai"

    def __init__(self, url: str, model: str, temperature: float = 0.0):
        self.host, self.port, self.base = _split_url(url)
        self.model = model
        self.temperature = temperature

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.gen_tokens,
            "min_tokens": spec.gen_tokens,
            "ignore_eos": True,
            "temperature": self.temperature,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=0.0)
        last_completion = [0]

        def on_event(msg: dict, t: float) -> None:
            usage = msg.get("usage") or {}
            n = None
            choices = msg.get("choices") or []
            if choices:
                tids = choices[0].get("token_ids")
                if tids is not None:
                    n = len(tids)
                pids = choices[0].get("prompt_token_ids")
                if pids:
                    rec.server_prompt_tokens = len(pids)
            if usage.get("completion_tokens") is not None:
                comp = int(usage["completion_tokens"])
                if n is None and choices:
                    # llama-server reports usage only in its last chunk, after one text chunk
                    # per token: count only what the chunks so far did not.
                    n = max(0, comp - max(last_completion[0], sum(k for _, k in rec.chunks)))
                last_completion[0] = max(last_completion[0], comp)
                rec.server_output_tokens = comp
                if usage.get("prompt_tokens") is not None:
                    rec.server_prompt_tokens = int(usage["prompt_tokens"])
            if n is None:
                n = 1 if choices and choices[0].get("text") else 0
            if n:
                rec.chunks.append((t, n))

        stream_sse(self.host, self.port, self.base + "/v1/completions", body, rec, timeout, on_event,
                    done_marker=b"[DONE]")
        return rec


class EngineDriver(Driver):
    """Submits to an in-process `EngineLoop` and times the outputs its callback receives: the
    same closed-loop clients and request list as the servers, without Triton, tokenizing models,
    gRPC or the client's process. Prompts are tokenized by the engine (text in, as the ensemble
    does)."""

    name = "engine"

    def __init__(self, loop: Any, temperature: float = 0.0):
        self.loop = loop
        self.temperature = temperature
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        from splitfuse.engine.sequence import SamplingParams

        events: queue.Queue = queue.Queue()
        with self._ids_lock:
            request_id = f"{spec.idx}-{client}-{next(self._ids)}"
        params = SamplingParams(max_tokens=spec.gen_tokens, min_tokens=spec.gen_tokens, ignore_eos=True,
                                temperature=self.temperature)
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=time.perf_counter())
        try:
            self.loop.submit(request_id, spec.prompt, params, lambda out: events.put((time.perf_counter(), out)))
        except Exception as e:  # noqa: BLE001 - recorded as the request's error
            rec.error, rec.end = f"{type(e).__name__}: {e}", time.perf_counter()
            return rec
        deadline = rec.start + timeout
        while True:
            try:
                t, out = events.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self.loop.abort(request_id)
                rec.error, rec.end = "timeout", time.perf_counter()
                return rec
            if out.delta_token_ids:
                rec.chunks.append((t, len(out.delta_token_ids)))
            rec.server_prompt_tokens = len(out.prompt_token_ids)
            rec.server_output_tokens = out.num_tokens - len(out.prompt_token_ids)
            if out.finished:
                rec.end = t
                if out.error is not None:
                    rec.error = out.error
                return rec
