"""Developer tools shipped with the package: the random-weight demo checkpoints tests and
benchmarks build (`python -m splitfuse.tools.demo_model`)."""
