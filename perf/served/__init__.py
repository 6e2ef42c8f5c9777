"""Served benchmarks: closed-loop streaming clients against real servers (FastGen method), their reports."""
