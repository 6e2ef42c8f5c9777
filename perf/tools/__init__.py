"""Tools that make benchmark inputs (not benchmarks themselves)."""
