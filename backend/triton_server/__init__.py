"""The Triton models and what they share; model_repository/*/1/model.py only import their
TritonPythonModel from here:

- `llm_model`: the `llm` model (the engine's adapter: requests in, streamed responses out,
  stops, cancellation, drain, metrics), with `live` (one request in flight), `request`
  (parsing a request's tensors), `response` (its output arrays), `metrics`, `replica_balance`
  (replicas sharing the load) and `control` (the file board between the `llm` instances and
  the launcher);
- `preprocessing`: the `preprocessing` model (tokenization for the ensemble).

What the prompt must pass (`InputError`, the prompt limit, chat rendering) is splitfuse.inputs.
`triton_python_backend_utils` exists only inside Triton's stub: `llm_model` and `preprocessing`
import it (tests/serving runs them in a real tritonserver), the rest is plain Python and numpy.
"""
