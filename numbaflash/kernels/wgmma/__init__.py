"""Kernels v3 and v4: the forward on Hopper's warpgroup tensor cores (wgmma, compute capability 9.0)."""
