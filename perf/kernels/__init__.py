"""Kernel micro-benchmarks: the C++ CPU kernels and the GPU kernels, low-precision and packed-weight paths offline."""
