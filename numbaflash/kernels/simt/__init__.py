"""Kernels v1: FlashAttention-2 forward and backward on the CUDA cores (any dtype), and their register tiles."""
