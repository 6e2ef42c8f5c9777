"""Load generators from NVIDIA: perf_analyzer and genai-perf against our server."""
