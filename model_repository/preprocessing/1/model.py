"""The `preprocessing` model: Triton's Python backend loads this file; the model is
splitfuse.triton_server.preprocessing (importable, and tested, as part of the package)."""

from splitfuse.triton_server.preprocessing import TritonPythonModel  # noqa: F401
