"""numbaflash: exact FlashAttention in Python with Numba CUDA kernels."""
