"""Peer systems built for the benchmarks only (never dependencies of the product)."""
