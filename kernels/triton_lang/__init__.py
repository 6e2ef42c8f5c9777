"""Triton-lang kernels for GPUs; each is tested against its torch reference in
`splitfuse.kernels.reference` (on CPU under TRITON_INTERPRET=1)."""
