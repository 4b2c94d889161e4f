"""`sim.hardware`: the bytes each kernel of a plan moves on a real GPU, beside `count_io`'s ideal hierarchy.

`count_io` counts elements between an ideal HBM and SRAM. A GPU counts otherwise: it serves global
memory in 32-byte sectors per warp instruction (so a row read by strided scalar loads costs more than
its bytes), and an L2 cache of 50 MB or more serves most re-reads of K and V before DRAM sees them.
`predict(plan)` walks every kernel the plan launches block by block, as the kernel code addresses
memory (`kernels`, `patterns`), and costs each warp instruction in sectors (`sectors`); DRAM bytes come
from an L2 model that follows the launch order (`l2`). `scripts/measure_io.py` holds both against
Nsight Compute's counters.
"""

from dataclasses import dataclass

import numpy as np

from numbaflash import arguments
from numbaflash.kernels.simt.backward import PREPROCESS_ROWS, STAGED_PREPROCESS_ROWS
from numbaflash.masks import normalize_window

from . import kernels, l2
from .gpu import H100, REGISTERS, Gpu
from .patterns import Operand


@dataclass(frozen=True)
class KernelTraffic:
    """One launch's bytes: requested from global memory (loads, cp.async copies, bulk tensor copies,
    stores, reductions; all in 32-byte sectors) and moved by DRAM after the L2 model."""

    kernel: str
    load_bytes: int
    copy_bytes: int
    tma_bytes: int
    store_bytes: int
    dram_read_bytes: int
    dram_write_bytes: int
    resident_blocks: int
    reduce_bytes: int = 0  # red.global.add of deterministic=False's dQ (`kernels.dkdv_blocks`)

    @property
    def async_bytes(self):
        return self.copy_bytes + self.tma_bytes

    @property
    def tma(self):
        return self.tma_bytes > 0

    @property
    def global_bytes(self):
        return self.load_bytes + self.async_bytes + self.store_bytes + self.reduce_bytes

    @property
    def dram_bytes(self):
        return self.dram_read_bytes + self.dram_write_bytes


@dataclass(frozen=True)
class HardwarePrediction:
    """Every launch's `KernelTraffic`, the call's FLOPs (4 d per visible score forward, 2.5 times that
    backward, as flash-attn counts them) and which units compute them ("tensor", "float32" or "float64")."""

    gpu: Gpu
    kernels: tuple
    flops: float
    compute: str

    def total(self, field):
        """A `KernelTraffic` field summed over the launches."""
        return sum(getattr(k, field) for k in self.kernels)

    @property
    def global_bytes(self):
        return self.total("global_bytes")

    @property
    def dram_bytes(self):
        return self.total("dram_bytes")

    @property
    def intensity(self):
        """FLOPs per DRAM byte."""
        return self.flops / max(self.dram_bytes, 1)

    def bound(self):
        """"memory" or "compute": which roof of the GPU's roofline is lower at this intensity, with the ridge
        point (FLOP/byte) it was judged against; None where the GPU's peaks are unknown."""
        if self.gpu.peaks is None:
            return None
        bandwidth, flops = self.gpu.peaks
        ridge = flops[self.compute] / bandwidth
        return ("memory" if self.intensity < ridge else "compute"), ridge


def visible_scores(seqlen_q, seqlen_k, left, right):
    """(query, key) pairs the mask lets through, for one head (`numbaflash.masks.key_range`, every row)."""
    pos = np.arange(seqlen_q, dtype=np.int64) + seqlen_k - seqlen_q
    lo = np.maximum(pos - left, 0) if left >= 0 else np.zeros_like(pos)
    hi = np.minimum(pos + right + 1, seqlen_k) if right >= 0 else np.full_like(pos, seqlen_k)
    return int(np.maximum(hi - lo, 0).sum())


def _operands(plan, operands):
    shapes = {"q": (plan.batch, plan.seqlen_q, plan.nheads, plan.headdim),
              "k": (plan.batch, plan.seqlen_k, plan.nheads_kv, plan.headdim),
              "lse": (plan.batch, plan.nheads, plan.seqlen_q)}
    for name, like in (("v", "k"), ("out", "q"), ("dout", "q"), ("dq", "q"), ("dk", "k"), ("dv", "k")):
        shapes[name] = shapes[like]
    shapes["delta"] = plan.delta_shape if plan.direction == "backward" else shapes["lse"]
    stat_bytes = 8 if plan.dtype == "float64" else 4
    ops = {name: Operand.contiguous(shape, stat_bytes if name in ("lse", "delta") else plan.dtype_bytes)
           for name, shape in shapes.items()}
    for name, op in (operands or {}).items():
        if name not in ops:
            raise ValueError(f"operands: unknown name {name!r}; accepted: {', '.join(ops)}")
        if not isinstance(op, Operand) or op.shape != ops[name].shape:
            raise ValueError(f"operands[{name!r}] must be a sim.hardware.Operand of shape {ops[name].shape}")
        ops[name] = op
    # deterministic=False's float32 dQ, which numbaflash allocates (`Plan.dq_acc_shape`), seen in the kernels'
    # axis order (batch, rows, heads, columns)
    acc = Operand.contiguous(plan.dq_acc_shape, 4)
    ops["dq_acc"] = Operand(tuple(acc.shape[i] for i in (0, 2, 1, 3)), tuple(acc.strides[i] for i in (0, 2, 1, 3)), 4)
    return ops


def _vector_staging(plan, ops, names):
    """Whether the launch stages these operands in vectors, as `numbaflash.interface.vector_staging` decides."""
    from numbaflash._arrays import vector_aligned
    from numbaflash.tiling import vector_elements

    count = vector_elements(plan.tiles)
    return all(vector_aligned(op.shape, op.strides, op.itemsize, op.offset, count) for op in (ops[n] for n in names))


def tile_visits(plan):
    """An upper bound on the tiles a walk of ``plan`` visits (no mask), which its run time follows: about
    100,000 per second."""
    t = plan.tiles
    per_head = -(-plan.seqlen_q // t.block_m) * -(-plan.seqlen_k // t.block_n)
    return plan.batch * plan.nheads * per_head * len(plan.launches)


def _blocks_per_sm(launch, gpu, tiles):
    # Tiles that share a multiprocessor are compiled to their share of its registers (their launch bounds)
    registers = REGISTERS.get(launch.kernel, 255 if tiles.blocks_per_sm == 1 else tiles.entry_registers)
    limits = (gpu.threads_per_sm // launch.threads, gpu.registers_per_sm // (registers * launch.threads),
              gpu.smem_per_sm // (launch.smem_bytes + 1024), 32)
    return max(1, min(limits))


def predict(plan, *, causal=False, window_size=(-1, -1), operands=None, gpu=None, block_mask=None):
    """Global and DRAM bytes of every kernel ``plan`` launches (a `numbaflash.plan(...)`).

    ``causal``, ``window_size``: the call's mask. ``operands``: `Operand` layouts by name (q, k, v, out,
    lse, dout, delta, dq, dk, dv) where they are not contiguous; ``gpu``: a `Gpu` (default: the current
    one, or `H100` without one); ``block_mask``: the call's `numbaflash.block_mask(...)`, whose empty
    tiles the kernels skip, and whose schedule they read (`schedules`: v5's, mma.sync's and the CUDA-core
    kernels'; v3's reads of it and the user's functions' own loads are left out). Returns a
    `HardwarePrediction`, one `KernelTraffic` per launch.
    """
    from numbaflash.block_sparsity import BlockMask
    from numbaflash.tiling import MmaTiles, Plan, WgmmaTiles

    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a numbaflash.plan(...) result; got {type(plan).__name__}")
    arguments.flag(causal, "causal")
    left, right = normalize_window(causal, arguments.window(window_size))
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be None or what numbaflash.block_mask(...) returns; got "
                            f"{type(block_mask).__name__}")
        block_mask.check_sizes(plan.batch, plan.nheads, plan.seqlen_q, plan.seqlen_k)
    gpu = Gpu.current() if gpu is None else gpu
    if not isinstance(gpu, Gpu):
        raise TypeError(f"gpu must be None or a sim.hardware.Gpu; got {type(gpu).__name__}")
    ops = _operands(plan, operands)
    forward_vec = _vector_staging(plan, ops, ("q", "k", "v"))
    backward_vec = _vector_staging(plan, ops, ("q", "k", "v", "dout"))
    forward = kernels.Walk(plan, ops, kernels.stager_for(plan, forward_vec), left, right, block_mask)
    backward = kernels.Walk(plan, ops, kernels.stager_for(plan, backward_vec), left, right, block_mask)
    walks = {
        "forward": lambda ledger: kernels.forward_blocks(forward, ledger),
        "simt_backward_preprocess": lambda ledger: kernels.preprocess_blocks(
            plan, ops, STAGED_PREPROCESS_ROWS if plan.staged_statistics else PREPROCESS_ROWS, ledger),
        "dkdv": lambda ledger: kernels.dkdv_blocks(backward, ledger),
        "dkdvdq": lambda ledger: kernels.dkdv_blocks(backward, ledger, accumulate_dq=True),
        "dq": lambda ledger: kernels.dq_blocks(backward, ledger),
        "dq_postprocess": lambda ledger: kernels.dq_postprocess_blocks(plan, ops, PREPROCESS_ROWS, ledger),
    }
    results = []
    for launch in plan.launches:
        ledger = kernels.Ledger()
        walks[WALKS[launch.kernel]](ledger)
        resident = gpu.sm_count * _blocks_per_sm(launch, gpu, plan.tiles)
        read, written = l2.dram_bytes(ledger.blocks, resident, gpu.l2_bytes)
        r = ledger.requested
        results.append(KernelTraffic(launch.kernel, r["load"], r["copy"], r["tma"], r["store"], read, written, resident,
                                     r["reduce"]))
    if block_mask is None:
        scores = plan.batch * plan.nheads * visible_scores(plan.seqlen_q, plan.seqlen_k, left, right)
    else:
        scores = block_mask.visible_scores(left, right, plan.batch, plan.nheads)
    flops = 4 * plan.headdim * scores
    compute = ("tensor" if isinstance(plan.tiles, (MmaTiles, WgmmaTiles)) else
               "float64" if plan.dtype == "float64" else "float32")
    return HardwarePrediction(gpu, tuple(results), flops * (2.5 if plan.direction == "backward" else 1), compute)


# Which walk models each launch (`numbaflash.tiling` names the launches).
WALKS = {"simt_forward": "forward", "mma_forward": "forward", "wgmma_forward": "forward",
         "wgmma_ws_forward": "forward", "wgmma_tma_forward": "forward",
         "simt_backward_preprocess": "simt_backward_preprocess", "wgmma_tma_backward_preprocess": "simt_backward_preprocess",
         "simt_backward_dkdv": "dkdv", "mma_backward_dkdv": "dkdv", "wgmma_backward_dkdv": "dkdv",
         "wgmma_tma_backward_dkdv": "dkdv",
         "simt_backward_dq": "dq", "mma_backward_dq": "dq", "wgmma_backward_dq": "dq", "wgmma_tma_backward_dq": "dq",
         "wgmma_tma_backward_dkdvdq": "dkdvdq", "backward_dq_postprocess": "dq_postprocess"}

__all__ = ["Gpu", "H100", "HardwarePrediction", "KernelTraffic", "Operand", "predict", "tile_visits", "visible_scores"]
