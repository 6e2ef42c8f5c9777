"""Small clients for the serving tests: gRPC streaming, HTTP generate(_stream), metrics."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# Triton dtype of every input the models accept (as in the config.pbtxt files).
INPUT_DTYPES = {
    "text_input": "BYTES", "input_ids": "INT32", "input_lengths": "INT32", "max_tokens": "INT32",
    "stream": "BOOL", "temperature": "FP32", "top_k": "INT32", "top_p": "FP32",
    "repetition_penalty": "FP32", "presence_penalty": "FP32", "frequency_penalty": "FP32",
    "min_tokens": "INT32", "min_length": "INT32", "seed": "UINT64", "random_seed": "UINT64",
    "ignore_eos": "BOOL", "stop_words": "BYTES", "end_id": "INT32", "exclude_input_in_output": "BOOL",
    "return_log_probs": "BOOL", "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL",
    "return_num_cached_tokens": "BOOL", "stop": "BOOL", "apply_chat_template": "BOOL",
    "cache_salt": "BYTES", "return_stop_handle": "BOOL", "stop_handle": "BYTES",
    "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES", "return_top_log_probs": "INT32",
    "lora_name": "BYTES", "priority": "INT32", "embeddings_only": "BOOL",
}
NP_DTYPES = {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32,
             "BOOL": np.bool_, "INT64": np.int64, "FP64": np.float64}


def make_inputs(values: dict[str, Any], dtypes: dict[str, str] | None = None) -> list:
    """{name: value} -> gRPC inputs shaped [1, 1] (scalars) or [1, n] (lists); arrays pass as is."""
    out = []
    for name, value in values.items():
        dtype = (dtypes or {}).get(name) or INPUT_DTYPES[name]
        if isinstance(value, np.ndarray):
            arr = value
        else:
            row = value if isinstance(value, list) else [value]
            if dtype == "BYTES":
                row = [v.encode("utf-8") if isinstance(v, str) else v for v in row]
            arr = np.array([row], dtype=NP_DTYPES[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@dataclass
class Response:
    text: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    log_probs: list[float] | None = None
    top_log_probs: np.ndarray | None = None
    """[1, tokens, k] as sent (return_top_log_probs=k); top_log_prob_ids likewise."""
    top_log_prob_ids: np.ndarray | None = None
    stop_handle: str | None = None
    final: bool = False
    embeddings: np.ndarray | None = None
    """[1, hidden] FP32 as sent (embeddings_only)."""


@dataclass
class StreamResult:
    responses: list[Response] = field(default_factory=list)
    error: str | None = None

    @property
    def data(self) -> list[Response]:
        """Responses that carry outputs (not the empty final flag)."""
        return [r for r in self.responses if r.text or r.output_ids or r.finish_reason]

    @property
    def text(self) -> bytes:
        return b"".join(r.text for r in self.responses)

    @property
    def output_ids(self) -> list[int]:
        return [i for r in self.responses for i in r.output_ids]

    @property
    def finish_reason(self) -> str:
        reasons = [r.finish_reason for r in self.responses if r.finish_reason]
        return reasons[-1] if reasons else ""


def _parse(result) -> Response:
    def get(name):
        arr = result.as_numpy(name)
        return None if arr is None else arr.reshape(-1)

    r = Response()
    params = result.get_response().parameters
    r.final = "triton_final_response" in params and params["triton_final_response"].bool_param
    text = get("text_output")
    if text is not None and text.size:
        r.text = b"".join(bytes(t) for t in text)
    ids = get("output_ids")
    if ids is not None:
        r.output_ids = ids.astype(int).tolist()
    reason = get("finish_reason")
    if reason is not None and reason.size:
        r.finish_reason = bytes(reason[0]).decode()
    for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens"):
        v = get(name)
        if v is not None:
            setattr(r, name, int(v[0]))
    handle = get("stop_handle")
    if handle is not None and handle.size:
        r.stop_handle = bytes(handle[0]).decode()
    lp = get("log_probs")
    if lp is not None:
        r.log_probs = lp.astype(float).tolist()
    r.top_log_probs, r.top_log_prob_ids = result.as_numpy("top_log_probs"), result.as_numpy("top_log_prob_ids")
    r.embeddings = result.as_numpy("embeddings")
    return r


class GrpcStream:
    """One gRPC bidirectional stream (one client); send requests, collect their responses."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, model: str, values: dict[str, Any], request_id: str = "",
             dtypes: dict[str, str] | None = None) -> None:
        self.client.async_stream_infer(model, make_inputs(values, dtypes), request_id=request_id,
                                       enable_empty_final_response=True)

    def next(self, timeout: float = 60.0) -> tuple[Response | None, str | None]:
        result, error = self.events.get(timeout=timeout)
        if error is not None:
            return None, str(error)
        return _parse(result), None

    def collect(self, timeout: float = 120.0, max_responses: int | None = None) -> StreamResult:
        """Responses of one request until its final flag (or an error)."""
        out = StreamResult()
        deadline = time.monotonic() + timeout
        while True:
            resp, err = self.next(timeout=max(0.1, deadline - time.monotonic()))
            if err is not None:
                out.error = err
                return out
            out.responses.append(resp)
            if resp.final or (max_responses is not None and len(out.responses) >= max_responses):
                return out

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def grpc_generate(url: str, model: str, values: dict[str, Any], request_id: str = "",
                  dtypes: dict[str, str] | None = None, timeout: float = 120.0) -> StreamResult:
    with GrpcStream(url) as s:
        s.send(model, values, request_id, dtypes)
        return s.collect(timeout)


# ---- HTTP ------------------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def http_generate(http_url: str, model: str, body: dict, timeout: float = 120.0) -> dict:
    """POST /v2/models/<model>/generate; returns the JSON (or {"error": ...} with "status")."""
    try:
        with _post(f"http://{http_url}/v2/models/{model}/generate", body, timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {**json.loads(e.read() or b"{}"), "status": e.code}


def http_generate_stream(http_url: str, model: str, body: dict, timeout: float = 120.0) -> list[dict]:
    """POST /v2/models/<model>/generate_stream; the JSON of each server-sent event."""
    events = []
    with _post(f"http://{http_url}/v2/models/{model}/generate_stream", body, timeout) as r:
        for raw in r:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                events.append(json.loads(line[5:].strip()))
    return events


# ---- metrics ---------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')


def metrics(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in metrics(metrics_url)
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


def finished_requests(metrics_url: str, reason: str) -> float:
    """Requests the llm model finished with `reason` (stop, length, abort, error), all replicas."""
    return metric_sum(metrics_url, "splitfuse_requests_finished_total", reason=reason)


def abort_and_length_ends(metrics_url: str) -> tuple[float, float]:
    """Requests the llm model has aborted, and run to their max_tokens (all replicas)."""
    return finished_requests(metrics_url, "abort"), finished_requests(metrics_url, "length")


def metric_by_instance(metrics_url: str, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in metrics(metrics_url):
        if n == name and all(lab.get(k) == want for k, want in labels.items()):
            out[lab.get("instance", "")] = out.get(lab.get("instance", ""), 0.0) + v
    return out


def settled(read, quiet_s: float = 0.6, timeout: float = 10.0):
    """read() once it has stopped changing for quiet_s (the llm model publishes metrics every
    0.5 s: a shorter quiet time can return before the first publish)."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = read()
        if again == value:
            return value
        value = again
    return value


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until predicate() is truthy; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


__all__ = ["InferenceServerException", "GrpcStream", "grpc_generate", "http_generate", "http_generate_stream",
           "metrics", "metric_sum", "metric_by_instance", "settled", "wait_for", "make_inputs", "StreamResult"]


# ---- processes -------------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out
