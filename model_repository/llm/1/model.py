"""The `llm` model: Triton's Python backend loads this file; the model is
splitfuse.triton_server.llm_model (importable, and tested, as part of the package)."""

from splitfuse.triton_server.llm_model import TritonPythonModel  # noqa: F401
