"""Process, port, cache-directory and CPU-budget helpers, each written once (the bottom layer:
imports nothing else of splitfuse)."""
