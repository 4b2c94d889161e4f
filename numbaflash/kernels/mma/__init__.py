"""Kernels v2: FlashAttention-2 forward and backward on mma.sync tensor cores (compute capability >= 8.0)."""
