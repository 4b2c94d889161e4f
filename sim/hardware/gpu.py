"""What the hardware model needs to know of a GPU: its multiprocessors, L2, and the peaks of the roofline."""

from dataclasses import dataclass, field

# Datasheet peaks (dense, without sparsity), by the name the driver reports: memory bandwidth in bytes/s
# and FLOP/s for the tensor cores (float16/bfloat16 in, float32 accumulate) and the CUDA cores' float32
# and float64 FMA. Measured on these hosts (KINDS.md): a device-to-device copy moved 3.0 TB/s on the
# H100 and 4.3 TB/s on the H200, and a bf16 matrix product ran at about 790 TFLOP/s on both.
PEAKS = {
    "NVIDIA H100 80GB HBM3": (3.35e12, {"tensor": 989e12, "float32": 67e12, "float64": 34e12}),
    "NVIDIA H200": (4.8e12, {"tensor": 989e12, "float32": 67e12, "float64": 34e12}),
}
# Registers per thread the L2 model assumes when it counts resident blocks: the kernels' real counts
# come from ptxas; the tensor-core and CUDA-core kernels use nearly all 255 (ncu: 1 or 2 blocks per
# SM, as this gives), the preprocess few (8 blocks per SM).
REGISTERS = {"simt_backward_preprocess": 32, "wgmma_tma_backward_preprocess": 32}


@dataclass(frozen=True)
class Gpu:
    """A GPU as the L2 model and the roofline see it. ``H100`` stands in where no GPU is present."""

    name: str
    sm_count: int
    l2_bytes: int
    smem_per_sm: int
    registers_per_sm: int = 65536
    threads_per_sm: int = 2048
    peaks: tuple = field(default=None)  # (bytes/s, {kind: FLOP/s}) or None where unknown

    @classmethod
    def current(cls):
        from numbaflash.kernels.intrinsics import SIMULATOR

        if SIMULATOR:
            return H100
        from numba import cuda

        dev = cuda.get_current_device()
        name = str(dev.name.decode() if isinstance(dev.name, bytes) else dev.name)
        return cls(name, dev.MULTIPROCESSOR_COUNT, dev.L2_CACHE_SIZE, dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                   peaks=PEAKS.get(name))


H100 = Gpu("NVIDIA H100 80GB HBM3", 132, 50 * 2**20, 228 * 1024, peaks=PEAKS["NVIDIA H100 80GB HBM3"])
