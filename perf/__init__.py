"""Benchmarks, grouped by what they measure (see perf/README.md). A package so that scripts in one
group import another's modules as `perf.<group>.<module>`; each script puts the repository root on
`sys.path` itself, so `python perf/<group>/<script>.py` works from anywhere."""
