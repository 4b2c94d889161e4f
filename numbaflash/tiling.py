"""The tiling plan: which kernels run, with which blocks, grids, threads and shared memory.

Computed in one place from the shapes, the dtype and the device, and used by the launches, by
`numbaflash.explain` and by `sim.count_io(plan=...)`, so the simulator counts the schedule the GPU ran.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

from . import arguments
from .kernels.intrinsics import SIMULATOR

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Device:
    """What the plan needs to know about the GPU (or the simulator)."""

    name: str
    compute_capability: tuple
    sm_count: int
    smem_per_block: int  # bytes a block may use with the opt-in limit raised

    @property
    def simulator(self):
        return self.compute_capability == (0, 0)


# The simulator allocates whatever shared memory a launch asks for; its plans may use what a Hopper GPU
# offers a block (the tensor-core backward's 32 x 32 blocks take 52 KiB at headdim 128).
SIMULATOR_DEVICE = Device("CUDA simulator", (0, 0), 1, 227 * 1024)


def current_device(ordinal=None):
    """The `Device` of GPU ``ordinal`` (default: numba's current one). A call's operands name their GPU, which
    saves asking numba for the current device (about 20 microseconds of a call's host time)."""
    if SIMULATOR:
        return SIMULATOR_DEVICE
    if ordinal is None:
        from numba import cuda

        ordinal = cuda.get_current_device().id
    return _device(ordinal)


@functools.lru_cache(maxsize=None)
def _device(ordinal):
    """Asked once per GPU: each attribute is a driver call, and every `attention` call plans."""
    from numba import cuda

    with cuda.gpus[ordinal]:
        dev = cuda.get_current_device()
        return Device(str(dev.name), tuple(dev.compute_capability), dev.MULTIPROCESSOR_COUNT,
                      dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


@dataclass(frozen=True)
class Tiles:
    """Register tiling of the CUDA-core kernels.

    A block owns ``block_m`` rows (queries; keys in the dK/dV kernel) and streams ``block_n`` columns at a
    time. Thread (r, c) computes a ``thread_m`` x ``thread_n`` patch of each score tile; the
    ``block_n / thread_n`` threads of a row group sit in one warp, so row maxima and sums are shuffles.
    ``float64_scores`` (the float32 forward): each score's dot product, its scaling and its difference from the
    row maximum in float64, rounded once before ex2 (`FLOAT64_SCORES`).
    """

    block_m: int
    block_n: int
    thread_m: int
    thread_n: int
    float64_scores: bool = False
    blocks_per_sm = 1  # no launch bound shares a multiprocessor's registers (`WgmmaTiles.blocks_per_sm`)

    @property
    def cols_t(self):
        return self.block_n // self.thread_n

    @property
    def threads(self):
        return (self.block_m // self.thread_m) * self.cols_t

    def thread_cols(self, D):
        """Output columns a thread accumulates for head dimension D."""
        return D // self.cols_t


@dataclass(frozen=True)
class MmaTiles:
    """Blocks of the tensor-core kernels: ``warps`` warps of ``m_tiles`` m-tiles (16 rows each) per block of
    ``block_m`` rows, ``block_n`` columns per streamed tile."""

    block_m: int
    block_n: int
    warps: int
    m_tiles: int = 1
    blocks_per_sm = 1  # no launch bound shares a multiprocessor's registers (`WgmmaTiles.blocks_per_sm`)

    def __post_init__(self):
        if self.block_m != self.rows_per_warp * self.warps:
            raise ValueError(f"tensor-core blocks have block_m = 16 x m_tiles x warps rows; got {self}")

    @property
    def rows_per_warp(self):
        return 16 * self.m_tiles

    @property
    def threads(self):
        return 32 * self.warps


@dataclass(frozen=True)
class WgmmaTiles:
    """Blocks of the wgmma kernels (Hopper): ``warpgroups`` warpgroups of 64 query rows each per block of
    ``block_m`` rows, ``block_n`` keys per streamed tile, K and V each in a ring of ``stages`` tiles; with
    ``producer``, one more warpgroup that only copies tiles (kernel v4, `wgmma.ws_forward`), with ``tma``
    as bulk tensor copies (kernel v5); with ``pingpong``, the consumer warpgroups take turns to issue
    their products, so one's softmax runs under another's (FlashAttention-3's schedule); ``exp2_fma`` of each
    row's ``block_n / 8`` 8-key chunks take the softmax's exponentials from a polynomial on the FMA pipe instead
    of the special-function unit's ex2 (`kernels.softmax.fma_chunk`; two at a time as float16 pairs where
    ``row_sums`` leaves float16 P no float32 use, `wgmma.tiles.pack_p`); ``blocks_per_sm`` blocks share a
    multiprocessor (2: each gets half its registers and shared memory, so one block's start and end run under
    the other's tiles; `wgmma.pipeline.register_moves`); with ``alibi_columns`` (v5) a call with ALiBi alone
    (`numbaflash.mods.Mods.alibi_alone`) takes each one-sided tile's column term from one more wgmma k-step
    (`wgmma.alibi_columns`), other calls ignore it; with ``row_sums`` (v5) the tensor cores sum each row's P
    beside P V (`wgmma.row_sums`) instead of the softmax's adds; with ``bounded_max`` (v5) a call with softcap alone
    takes softcap's bound for every row's maximum (`fixed_maximum`), other calls ignore it; with ``scores_ahead`` (v5
    forward) each consumer issues a key tile's S = Q K^T one tile early, into a second register set, so that it runs
    under the softmax of the tile before it (a rung of the ladder no plan takes since three consumers ran softcap at
    headdim 128 faster, `WGMMA_SOFTCAP_TILES`); with ``dq_deferred`` (v5 backward) the dQ pass issues each key tile's dQ +=
    dS K after the next tile's S and dP, so that it runs under that tile's dS."""

    block_m: int
    block_n: int
    warpgroups: int
    stages: int = 2
    producer: bool = False
    tma: bool = False
    pingpong: bool = False
    exp2_fma: int = 0
    blocks_per_sm: int = 1
    alibi_columns: bool = False
    row_sums: bool = False
    bounded_max: bool = False
    scores_ahead: bool = False
    dq_deferred: bool = False

    def __post_init__(self):
        if self.block_m != 64 * self.warpgroups:
            raise ValueError(f"wgmma blocks have block_m = 64 x warpgroups rows; got {self}")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"wgmma key tiles have a multiple of 16 keys, 16 to 256 (wgmma's N); got {self}")
        if self.stages != 2 and not (self.producer and 2 <= self.stages <= 4):
            raise ValueError(f"the wgmma kernels run a two-stage K/V ring, a producer's ring 2 to 4 stages; got {self}")
        if self.tma and not self.producer:
            raise ValueError(f"bulk tensor copies (tma) are issued by a producer warpgroup; got {self}")
        if not 0 <= self.exp2_fma <= self.block_n // 8:
            raise ValueError(f"exp2_fma counts 8-key chunks of a key tile, 0 to block_n / 8; got {self}")
        if self.pingpong and not (self.producer and self.warpgroups >= 2):
            raise ValueError(f"ping-pong takes turns between two or more consumer warpgroups beside a producer; "
                             f"got {self}")
        if self.blocks_per_sm not in (1, 2) or self.blocks_per_sm == 2 and not (self.producer and self.warpgroups == 1):
            raise ValueError(f"two blocks share a multiprocessor with one consumer warpgroup beside a producer "
                             f"(blocks_per_sm 1 or 2); got {self}")
        if self.alibi_columns and not self.tma:
            raise ValueError(f"ALiBi's column term from the tensor cores (alibi_columns) is v5's (tma=True); got {self}")
        if self.row_sums and not self.tma:
            raise ValueError(f"row sums from the tensor cores (row_sums) are v5's (tma=True); got {self}")
        if self.bounded_max and not self.tma:
            raise ValueError(f"softcap's bound as each row's maximum (bounded_max) is v5's (tma=True); got {self}")
        if self.scores_ahead and not self.tma:
            raise ValueError(f"a tile's scores issued ahead of the softmax before them (scores_ahead) are v5's "
                             f"(tma=True); got {self}")
        if self.dq_deferred and not (self.tma and self.stages >= 3):
            # its stage is released a tile later: with two the producer waited for each release (`WGMMA_BACKWARD_TILES`)
            raise ValueError(f"the dQ pass's deferred dQ += dS K (dq_deferred) is v5's (tma=True), through a ring of 3 "
                             f"or 4 stages; got {self}")

    @property
    def threads(self):
        return 128 * (self.warpgroups + self.producer)

    def exp2_pairs(self, dtype):
        """Whether the ``exp2_fma`` chunks take their exponentials two at a time as float16 pairs: where the tensor
        cores sum P's rows (``row_sums``), a float16 P has no float32 use (`wgmma.tiles.pack_p`)."""
        return self.exp2_fma > 0 and self.row_sums and dtype == "float16"

    @property
    def entry_registers(self):
        """Registers a thread starts with under launch bounds of ``blocks_per_sm`` blocks per multiprocessor (of
        65,536; `kernels.compiled` sets them when ``blocks_per_sm`` > 1), before setmaxnreg shares them out."""
        return 65536 // (self.blocks_per_sm * self.threads) // 8 * 8

    # wgmma gives each warp of a (consumer) warpgroup one m-tile of 16 rows in mma.sync's accumulator layout.
    @property
    def warps(self):
        return 4 * self.warpgroups

    @property
    def m_tiles(self):
        return 1

    @property
    def rows_per_warp(self):
        return 16

    @property
    def kernel(self):
        return "wgmma_tma_forward" if self.tma else "wgmma_ws_forward" if self.producer else "wgmma_forward"


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple
    threads: int
    smem_bytes: int


# Preferred tilings of the CUDA-core kernels, best first: the plan takes the first whose shared memory
# fits the device and, in the forward, that keeps at most MAX_THREAD_COLS output columns per thread
# (past that NVVM stops unrolling the forward's accumulator loops and the accumulator falls into local
# memory: a 256-byte stack frame at 16 columns in the ptxas report, none at 8 or 12; the backward
# kernels showed no stack frame at 16). 4x4 score patches do 16 FMAs per two 16-byte shared loads.
MAX_THREAD_COLS = 12
# The float32 forward's scores in float64 (`Tiles.float64_scores`) on GPUs that run float64 at half the float32 rate
# (P100, V100, A100, H100, B200; others run it at 1/32-1/64): with logits in the thousands float32 scores are
# quantized by ~1e-3, and P with them (`kernels.simt.forward`). Their 4 x 4 patches take 250-254 registers at 256
# threads (ptxas 13.0, sm_90) and spill 260 bytes under the 512-thread tiling's 128 (FLOAT64_SCORES_SPILL).
FLOAT64_SCORES = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})
FLOAT64_SCORES_SPILL = frozenset({Tiles(128, 64, 4, 4)})
SIMT_TILES = {
    # 128 x 64 with 512 threads measured fastest on the H200 (N = 4096: 23.5 TFLOP/s at headdim 64,
    # against 16.8 for 64 x 64 and 256 threads): its launch bounds hold it to 128 registers, and twice the
    # rows share every K and V load. At headdim 128 it spills under that cap (MAX_HEADDIM), so 64 x 64
    # runs there (19.1 TFLOP/s). Last resort for GPUs with 64 KiB of shared memory per block (Turing):
    # 16 x 16 tiles fit headdim 256.
    ("forward", "float32"): (Tiles(128, 64, 4, 4), Tiles(64, 64, 4, 4), Tiles(32, 64, 2, 2), Tiles(32, 32, 2, 1),
                             Tiles(16, 16, 1, 1), Tiles(8, 8, 1, 1)),
    ("forward", "float64"): (Tiles(32, 32, 2, 2), Tiles(16, 32, 1, 1), Tiles(16, 16, 1, 1), Tiles(8, 8, 1, 1)),
    # The backward's two passes share one square block (the schedule `sim` counts uses one B_r = B_c).
    ("backward", "float32"): (Tiles(64, 64, 4, 4), Tiles(32, 32, 2, 2), Tiles(16, 16, 1, 1), Tiles(8, 8, 1, 1)),
    ("backward", "float64"): (Tiles(32, 32, 2, 2), Tiles(16, 16, 1, 1), Tiles(8, 8, 1, 1)),
}
# Head dims past which a tiling is not considered. float64 doubles every register: on the H200 the dQ
# kernel spilled 32 bytes at headdim 128 with 2x2 patches. The 512-thread forward tiling is capped at 128
# registers by its launch bounds, and at headdim 128 ptxas spills 20 bytes under that cap.
MAX_HEADDIM = {("backward", "float64", Tiles(32, 32, 2, 2)): 64, ("forward", "float32", Tiles(128, 64, 4, 4)): 64}
# The simulator runs one Python thread per CUDA thread: small blocks (64 threads) keep CI fast while
# running the same kernel source, with its masking, tiling and shuffles.
SIMULATOR_TILES = Tiles(16, 16, 2, 2)

# Tensor-core forward, by head-dim bucket: 4 warps of 2 m-tiles (32 query rows each), so that every K
# and V fragment a warp reads from shared memory feeds two mma (H200, fp16, against SDPA flash in the
# same run: at headdim 64, 128 x 64 blocks ran 0.64-0.78x, 8 warps of one m-tile with 128-key tiles
# 0.56-0.69x; at headdim 128, 128 x 32 ran 0.62-0.69x against 0.58-0.71x, N = 2048 to 16384, causal and
# not). Headdim 128 takes 32-key tiles because its 2 x 16 x 128 accumulators leave no registers for
# 64 (ptxas spilled 192 bytes). At headdim 256 the accumulators of two m-tiles do not fit at all: 64 x 64
# with 4 warps of one m-tile (a 128-row block would need 330 KiB of shared memory).
# One warp of 2 m-tiles and 16 keys on the simulator, where each warp-wide instruction is an exchange
# between 32 Python threads.
MMA_HEADDIMS = (16, 32, 64, 128, 256)
MMA_TILES = {16: MmaTiles(128, 64, 4, 2), 32: MmaTiles(128, 64, 4, 2), 64: MmaTiles(128, 64, 4, 2),
             128: MmaTiles(128, 32, 4, 2), 256: MmaTiles(64, 64, 4)}
SIMULATOR_MMA_TILES = MmaTiles(32, 16, 1, 2)
# wgmma forward (compute capability 9.0), by head-dim bucket; two or three consumer warpgroups of 64 query
# rows share every K and V tile. The ladder, as measured:
# - H200, fp16, N = 4096 and 16384 against SDPA flash in the same run (.bench/wgtiles.py, wscheck.py,
#   tmacheck.py): v3 (every warpgroup copies with cp.async, then computes) 0.73-0.88x at headdim 64 (128 x
#   112) and 0.76-0.91x at 128 (128 x 64); v4 (a producer warpgroup copying with cp.async) 0.60-0.73x, its
#   four warps unable to issue a tile's 16-byte copies fast enough; v5 (the producer issuing one bulk tensor
#   copy per swizzle atom) 0.95-1.11x at headdim 64.
# - H100, ping-pong and v5 at headdim 128 x 128 (.bench/pingpong.py, pingpong2.py): 0.70-1.16x at 64 and
#   0.74-1.05x at 128, N = 2048 to 16384. Those v5 builds put the tensor-map acquire fence before every
#   bulk copy, which invalidated the copy engine's descriptor cache each time: consumers waited for tiles
#   26% of the time (ncu source counters, .bench/srcprof.py).
# - H100 after the fix (acquire once per block; .bench/plans.py, fp16, N = 2048 to 16384, causal and not,
#   batch x N = 16384, 16 heads): headdim 64 at 192 x 96 with three consumers 0.78-1.38x, against 0.71-1.27x
#   at 128 x 128 with two; headdim 128 at 128 x 128 0.83-1.55x (128 x 160 equal within noise); headdim
#   256 at 128 x 48 1.07-1.65x, against mma.sync's 0.43-0.53x (128 x 64 ran 1.24-1.82x but keeps 8 bytes
#   of local memory; 128 x 48 keeps none).
# Three consumers get 160 registers each (`wgmma.pipeline.REGISTERS`). softcap, ALiBi and block masks fit in
# them since their steps compare each score's column with a per-row range and the built-in modifications
# apply to every score before the mask (`kernels.softmax`; before that, at 152 registers, ptxas 13.0 kept
# 164-432 bytes of local memory). The user's per-score functions (a score_mod, or a mask_mod without a block
# mask's bits) still spill in three (72-164 bytes): such calls at headdim 64 run two (WGMMA_USER_FUNCTION_TILES).
# Inputs the copy engine cannot read (`make_plan`'s ``aligned``) run v3 with cp.async (WGMMA_CP_ASYNC_TILES);
# at headdim 256, which v3 has no tiles for, mma.sync (on the simulator too). Packed (varlen) sequences run
# v5 too: its tensor maps span the packed operands (`wgmma.ws_forward`); before, they ran v3, and varlen ran
# 0.50-0.57x the same tokens as a batch at equal lengths (H200, scripts/bench_varlen.py).
# Head dims up to 32 stay on mma.sync, whose 16- and 32-wide buckets pad less than wgmma's 64-wide atoms.
# On the simulator one warpgroup and 16-key tiles, the smallest wgmma.
WGMMA_HEADDIMS = (64, 128, 256)
WGMMA_MIN_HEADDIM = 33
WGMMA_TILES = {64: WgmmaTiles(192, 96, 3, producer=True, tma=True, pingpong=True),
               128: WgmmaTiles(128, 128, 2, producer=True, tma=True, pingpong=True),
               256: WgmmaTiles(128, 48, 2, producer=True, tma=True, pingpong=True)}
WGMMA_USER_FUNCTION_TILES = {64: WgmmaTiles(128, 128, 2, producer=True, tma=True, pingpong=True)}
# softcap alone (`numbaflash.mods.Mods.softcap_alone`) at headdim 64 pays tanh and ex2 per score on the
# special-function unit, which then bounds the forward: 2 of each row's 12 8-key chunks take their ex2 from
# the FMA pipe (`ex2_fma`). H200, fp16, N = 16384, 16 heads, stream timing (.bench/fma_sweep.py), softcap's
# forward over the plain kernel's: 1.41x with none, 1.36x with 3, 1.36x with 4, 1.40x with 6, 1.50x with 8;
# the plain kernel itself ran 5-36% slower with 3-12 (it is not bound there), and so did headdim 128 softcap.
# Again on the H100 (2026-11-26, .bench/cap_fwd.py): at 64 1.40x with none, 1.37x with 4, 1.45x with 6 (128 x
# 128 blocks 1.38-1.39x); at 128 1.15x with none, 1.17-1.18x with 2, 4 or 6 of 16. Three runs of each on the H100
# (2026-11-26, .bench/cap_ab.py, non-causal then causal, means): 1.38x and 1.37x with none, 1.38x and 1.34x with 2,
# 1.39x and 1.37x with 3, 1.40x and 1.38x with 4: 2 (it was 4).
# At headdim 128 softcap's softmax, tanh and ex2 per score, takes about as long as another consumer's products of a 64
# x 128 tile: with two consumers it sat exposed, with three on 80-key tiles two others' products run under it.
# softcap's forward over the plain one's (H200, 2026-11-28, fp16 unless said, N = 16384, 16 heads, no LSE, five
# interleaved rounds each, .bench/cap_sweep.py), these tiles against the 128 x 96 ones below in the same run: 1.172x
# (1.169-1.176) against 1.191x, and after the change 1.165x against 1.172x, causal 1.176x against 1.173x, bfloat16
# with its bound 1.096x against 1.142x; packed sequences (.bench/cap_varlen.py, over the plain varlen forward) 64 of
# 32-1024 tokens 1.087x against 1.185x (causal 1.151x against 1.237x), 16 of 1024 1.308x against 1.342x (causal 1.340x
# against 1.293x), with 32 bytes of local memory where those tiles had 20 (ptxas 13.0). Not taken: 192 x 80 with
# ping-pong 1.165x and 1.172x (causal 1.165x, bfloat16 1.088x) with 32 bytes of local memory (ptxas 13.0: 160
# registers a consumer are three consumers' most, `wgmma.pipeline.REGISTERS`; without ping-pong none), in three stages
# 1.164x (causal 1.181x); 192 x 64 1.179x, with ping-pong 1.203x (three stages 1.223x, 2 chunks of ex2 on the FMA pipe
# 1.262x); 192 x 96 1.283x, with ping-pong 1.456x (80 bytes of spills). At headdim 64 three consumers on 80 keys ran
# 1.420x (with ping-pong 1.396x), on 96 without ping-pong 1.372x and on 112 with it 1.350x, against the plan's 1.346x
# (its row sums and float16 pairs in each).
# Before it, each consumer issued a tile's S a tile ahead (`WgmmaTiles.scores_ahead`), in 96-key tiles whose two S
# register sets fit two consumers (128 keys spilled 264 bytes, 112 spilled 64; ptxas 13.0), without ping-pong:
# its time over the 128 x 128 ping-pong tiles' 0.953 (0.951-0.957), 0.983 (0.956-0.984) and 0.958 (0.939-0.967x)
# in three runs (H100, 2026-11-27, fp16, N = 16384, 16 heads, no LSE, three rounds each, .bench/ahead.py), with
# ping-pong 0.980, in 64-key tiles 1.009-1.025, with 2 or 4 chunks of ex2 on the FMA pipe 1.00-1.02, without
# ahead 1.03 (96 keys) and 0.99 (128); with three consumers its second S spills (232 bytes at 192 x 64). At 64
# none beat the plan above: 128 x 128 0.988-1.043x its time (with 2-8 chunks of float16 pairs 0.997-1.021x),
# 128 x 96 1.035-1.092x, 192 x 64 1.044x; the plain kernels ran slower (1.05x at 128, 1.10-1.21x at 64).
WGMMA_SOFTCAP_TILES = {64: dataclasses.replace(WGMMA_TILES[64], exp2_fma=2),
                       128: WgmmaTiles(192, 80, 3, producer=True, tma=True)}
SOFTCAP_CONSUMERS_REASON = (f"softcap's tanh and ex2 per score: {WGMMA_SOFTCAP_TILES[128].warpgroups} consumer "
                            f"warpgroups on {WGMMA_SOFTCAP_TILES[128].block_n}-key tiles, so the others' products run "
                            "under each one's softmax")
# With the tensor cores' row sums (`ROW_SUMS_HEADDIMS`) a float16 P is needed only as the 16-bit words P V takes, so
# the FMA pipe's chunks take their exponentials two at a time as float16 pairs (`ex2_fma_f16x2`: 11 instructions a
# pair, 4 of them HFMA2, against `ex2_fma`'s 9 a score and the pair's conversion), and more chunks pay. H100,
# 2026-11-27, fp16, N = 16384, 16 heads, no LSE, softcap's forward over the plain one's (.bench/pairs_sweep.py, min of
# 2-3 rounds per run): float32 polynomials in 2 chunks 1.396, 1.377, 1.395x (causal 1.372, 1.369, 1.422x); float16
# pairs in 5 chunks 1.352, 1.347x (causal 1.353, 1.353x), in 2, 4, 6, 7 and 8 1.37, 1.37, 1.35-1.41, 1.36-1.39 and
# 1.39x. The plain forward with 4 chunks of pairs ran 1.06x its own time.
WGMMA_SOFTCAP_PAIR_CHUNKS = {64: 5}
# ALiBi alone at headdim 64 takes a one-sided tile's column term from one more wgmma k-step (`wgmma.alibi_columns`):
# its per-score FFMA and per-tile column products and conversions had made its forward 1.09-1.12x the plain one's
# (1.13-1.18x causal), 1.08-1.11x (1.07-1.10x) with it and `key_tiles.tile_order`'s order (H100 and H200, fp16,
# N = 16384, 16 heads, .bench/alibi_ab.py). At 128 a first build ran 1-3% slower than without (H100).
# Packed sequences keep the per-score bias: with the column operands v5's packed forward at 64 spills 124 bytes
# (64 without; ptxas 13.0).
WGMMA_ALIBI_TILES = {64: dataclasses.replace(WGMMA_TILES[64], alibi_columns=True)}
# A forward whose caller takes no LSE (`make_plan`'s ``lse``), with softcap alone or ALiBi alone at these head dims,
# takes its row sums from the tensor cores (`wgmma.row_sums`, 48 FADDs a warp's tile fewer): the sums of P rounded to
# 16 bits, which normalize out exactly (its error against float64 fell by a third) but leave the LSE off by up to P's
# rounding, past flash-attn's rule in 29 and 36 of 80 random float16 and bfloat16 cases emulated in NumPy. softcap's
# forward over the plain one's at 64: 1.411, 1.423, 1.398 -> 1.343, 1.338, 1.324 (causal 1.40-1.42x -> 1.33-1.35x);
# ALiBi's 1.09-1.12x -> 1.08-1.10x (H100, 2026-11-27, fp16, N = 16384, 16 heads, three paired runs,
# .bench/ab_run.sh cap_ab.py and alibi_ab.py); with them 0, 3, 4 or 6 of softcap's 12 chunks on the FMA pipe ran
# 1.34x, 1.35x, 1.37x and 1.40x against 2's 1.32x. The plain forward at 64 ran the same with them (2.445 against
# 2.452 ms), softcap and ALiBi at 128 4-6% slower (.bench/sums_ab.py): they keep the softmax's adds.
ROW_SUMS_HEADDIMS = (64,)
ROW_SUMS_REASON = ("the LSE is not asked for: the tensor cores sum each row's P beside P V (one m64n8 wgmma per "
                   "k-step), not the softmax")
# softcap alone in bfloat16 with softcap * log2(e) <= BOUNDED_MAX_LOG2: every score is below the cap, so v5's forward
# takes the cap, less `kernels.softmax.RESCALE_LOG2`, for each row's maximum, and forms no row maxima (48 FMNMX, the
# quad's shuffles and the rescaling a warp's tile fewer at headdim 64): P lies in (2^(8 - 2 softcap log2(e)), 2^8], no
# larger than with running maxima, and normal in bfloat16 and float32 down to 30 bits under a row's largest P.
# float16's P would underflow (its exponent stops at 2^-24). The price, where a row's every score sits at -softcap: its
# P near 2^-96 times V entries under 2^-30 falls below float32's normal range in P V. softcap's forward over the plain
# one's, running maxima -> the bound (H100, 2026-11-27, bfloat16, N = 16384, 16 heads, stream timing,
# .bench/bounded_ab.py, two runs): at 64 1.410, 1.425 -> 1.322, 1.343x (causal 1.385, 1.405 -> 1.279, 1.296x); at 128
# 1.150, 1.192 -> 1.116, 1.115x (causal 1.206, 1.162 -> 1.143, 1.137x); at 256 (one run) 1.081 -> 0.869x (causal
# 1.115 -> 0.883x): there the plain kernel's maxima cost more than softcap's tanh.
BOUNDED_MAX_LOG2 = 52.0
BOUNDED_MAX_REASON = ("bfloat16 softcap: the scores' bound, softcap, less 8 (base 2), is each row's maximum (no row "
                      "maxima formed)")


def fixed_maximum(dtype, softcap):
    """Whether softcap alone at ``softcap`` in ``dtype`` may take its bound for each row's maximum (`WgmmaTiles.
    bounded_max`): bfloat16, and softcap * log2(e) at most `BOUNDED_MAX_LOG2`."""
    return dtype == "bfloat16" and 0.0 < softcap * LOG2E <= BOUNDED_MAX_LOG2


WGMMA_CP_ASYNC_TILES = {64: WgmmaTiles(128, 112, 2), 128: WgmmaTiles(128, 64, 2)}
# A block mask's call at headdim 64: blocks of one consumer warpgroup, two per multiprocessor
# (`WgmmaTiles.blocks_per_sm`). A block costs about 9 microseconds beyond its tiles (H200, v5 forward at headdim
# 64 and 128: the fit of time against key tiles per block, .bench/docs_tiles.py), what 6.7 of its 192 x 96
# tiles take; 8 documents of 2048 tokens leave a block about 13 of them, so a sixth of the forward was that.
# Two blocks per multiprocessor run one's start and end under the other's tiles. Same run, 16 heads, N = 16384
# (.bench/bps.py): 8 documents' forward took 0.262 ms against 0.294 (4.59x -> 5.17x faster than dense causal)
# and their backward (64 x 64) 1.183 against 1.297 ms, while dense causal stayed at 1.36 ms forward (three
# consumers: 1.35) and 4.30 backward. At headdim 128 the forward's blocks already did as well (5.35x against
# 5.28x) and the dK/dV pass of one consumer spills 196 bytes at 128 registers (ptxas 13.0).
# Taken for every block mask backward, and forward where its blocks visit few tiles (`WGMMA_BLOCK_SPARSE_DENSE_VISITS`):
# before a full tile was tested against nothing, the dense plan's tiles gained nothing forward (causal as a block mask
# 1.355 -> 1.375 ms, 4 documents 0.424 -> 0.419) and 3% backward at most (H100, .bench/shared_cross.py).
WGMMA_BLOCK_SPARSE_TILES = {64: WgmmaTiles(64, 128, 1, producer=True, tma=True, blocks_per_sm=2)}
# Their dQ pass waits for each tile's dQ += dS K. Against the built-in causal backward (H100, fp16, N = 16384, 16 heads,
# stream timing, 2026-11-28), the causal block mask on them ran 1.091x (1.077-1.115 over three interleaved rounds);
# with the deferral of `WGMMA_BACKWARD_TILES` (three stages) 1.077x (1.045-1.101) and on the dense plan's tiles 1.071x
# (1.067-1.080), each in a process of its own (.bench/bs_bwd.py); 2, 4, 8 and 16 documents 0.582, 0.324, 0.192, 0.127
# on these, 0.587, 0.317, 0.193, 0.127 deferred, 0.577, 0.333, 0.208, 0.142 dense. Planned the dense tiles and these
# in one process, five rounds (.bench/bs_ab.py): 1.063x (1.047-1.096) against 1.056x (1.006-1.087), so these stay
# (the simulator's block-mask backward tests run both dQ loops, these tiles' and the deferred ones).
WGMMA_BLOCK_SPARSE_BACKWARD_TILES = {64: WgmmaTiles(64, 64, 1, producer=True, tma=True, blocks_per_sm=2)}
# A block mask whose query blocks visit many key tiles pays each block's start and end over many tiles, and the dense
# plan's tiles (three consumers taking turns) run those tiles faster than the shared blocks' one consumer: the forward
# at headdim 64 takes them where a block of theirs visits at least this many key tiles on average
# (`block_visits_tiles`). Once a full tile was tested against nothing (`block_sparsity.BlockMask.unmasked`), on the
# H100 (fp16, 16 heads, .bench/density.py; the shared blocks' time over the dense plan tiles', a block's mean visits
# at 192 x 96 in brackets): N = 16384 causal 1.034 (87), 2 documents 1.04 (44.5), 4 1.01 (23), 8 0.96 (12.6), 16
# 0.97 (7.3); N = 8192 causal 0.97 (44), 2 documents 0.92 (23.5), 4 0.92 (12.5). The causal block mask at 16384 also
# ran 1.117, 1.093x the built-in causal on the shared blocks against 1.070, 1.054x on these (.bench/visit_ab.py).
WGMMA_BLOCK_SPARSE_DENSE_VISITS = 64
SHARED_BLOCKS_REASON = ("a block mask leaves each block few tiles: blocks of one consumer warpgroup, two per "
                        "multiprocessor, so one block's start and end run under the other's tiles")
SIMULATOR_WGMMA_TILES = WgmmaTiles(64, 16, 1)
# wgmma backward (compute capability 9.0). v5 (`wgmma.ws_backward`): a producer warpgroup's bulk tensor copies
# and two consumer warpgroups of 64 keys (dK/dV) or 64 query rows (dQ) each, streaming 64-row tiles. On the
# H100 (fp16, N = 2048 and 8192, causal and not, .bench/wsbwd.py) it ran 0.89-0.98x SDPA flash's backward at
# headdim 128 and 0.62-0.67x at 64, against mma.sync's 0.52-0.60x and 0.56-0.63x in the same run; three
# stages ran no faster than two, 32-row streamed tiles slower (0.82-0.84x at 128), and 128-row ones spill
# at 64 (dK/dV). v3 (`wgmma.backward`, no plan picks it): one warpgroup of square 64 x 64 blocks copying
# with cp.async ran 0.42-0.52x, below mma.sync, with the tensor cores idle while it formed P and dS.
# The dQ pass issues each tile's dQ += dS K after the next tile's S and dP (``dq_deferred``), through three stages,
# since the stage it reads is released a tile later: the backward's time over the two stages without it (H100,
# fp16, N = 16384, 16 heads, three interleaved rounds, .bench/pdp.py): on the final code plain 0.973 at headdim 64
# and 0.979 at 128, softcap 0.993 and 0.964; in three runs before, plain 0.967-0.973 and 0.972-0.978, softcap
# 0.996-0.999 and 0.968-0.972, ALiBi 0.995 and 0.972. With two stages the producer waited for each release: 1.13x
# and 1.17x the plain backward's time. Not kept: ping-pong turns of the two dQ consumers on top (0.960-0.998, within
# the runs' spread), four stages (0.964-0.980), P formed while dP runs without the deferral (0.993-1.021), and a
# quarter or half of the dQ pass's exponentials on the FMA pipe with softcap (1.000-1.015 at 64). softcap's backward at
# 128 over the plain one's on other spill-free tiles (H200, 2026-11-29, scripts/bench_tiles.py --backward, five rounds):
# these 1.129x, in four stages 1.129x, 128 x 48 in three 1.212x.
WGMMA_BACKWARD_TILES = {64: WgmmaTiles(128, 64, 2, 3, producer=True, tma=True, dq_deferred=True),
                        128: WgmmaTiles(128, 64, 2, 3, producer=True, tma=True, dq_deferred=True)}
WGMMA_CP_ASYNC_BACKWARD_TILES = {64: WgmmaTiles(64, 64, 1), 128: WgmmaTiles(64, 64, 1)}
SIMULATOR_WGMMA_BACKWARD_TILES = WgmmaTiles(64, 16, 1, 3, producer=True, tma=True, dq_deferred=True)
# deterministic=False with v5's tiles asked for (``tiles=``): v5's dK/dV kernel also forms dQ = dS K from its
# dS^T, stored in shared memory as rows of this many query columns (one swizzle atom, wgmma's M), and adds it
# to a float32 dQ with atomics, at the padded head dims below (at 128 its dK/dV kernel spilled 168 bytes and
# ran 0.80-0.88x SDPA flash against the two passes' 0.85-0.98x, .bench/atomicbwd.py). A planned call
# (``tiles=None``) runs the deterministic two passes: since their steps skip the per-score tests on whole tiles
# they are the faster at 64 too (H100, fp16, N = 2048 to 16384, causal and not, scripts/bench.py
# --deterministic no / yes: atomic 0.82-1.02x SDPA flash, two passes 0.92-1.19x; before that change the atomic
# dQ led, 0.67-0.79x against 0.60-0.66x).
WGMMA_ATOMIC_DQ = 64
WGMMA_ATOMIC_DQ_HEADDIMS = (64,)
# Except with softcap (without a score_mod or mask_mod, packed sequences or a block mask): the two passes each form
# every score's tanh and ex2, the atomic dQ's one pass once, and at headdim 64 the special-function unit that runs
# them is what softcap's backward waits on (docs/modifications.md). A planned deterministic=False call with softcap
# runs the atomic dQ there. Its time over the two passes' (H100, fp16, 16 heads, three interleaved rounds,
# .bench/atomic2.py): softcap 30 0.921 (N = 16384) and 0.953 (4096), causal 0.936 and 0.937, with ALiBi 0.908 and
# 0.916; without softcap it ran slower or level: plain 1.063 and 1.085, causal 1.012 and 1.085, ALiBi alone 1.001
# and 0.991.
ATOMIC_DQ_SOFTCAP_REASON = ("softcap: the one pass forms each score's tanh and ex2 once, the two passes twice (it ran "
                            "5-9% faster)")
# Tensor-core backward: square blocks, because `sim` counts one B_r = B_c for both passes (the dK/dV
# kernel owns block_m keys and streams block_n queries; the dQ kernel the reverse). Up to headdim 64,
# 4 warps of 2 m-tiles (H200, fp16, N = 2048 to 16384, causal and not: 0.54-0.65x SDPA flash, against
# 0.39-0.53x for 64 x 64 blocks of 4 warps of one m-tile). At headdim 128 two m-tiles' dK and dV would
# take every register: 8 warps of one m-tile (0.52-0.63x, against 0.49-0.62x for 64 x 64).
MMA_BACKWARD_TILES = {16: MmaTiles(128, 128, 4, 2), 32: MmaTiles(128, 128, 4, 2), 64: MmaTiles(128, 128, 4, 2),
                      128: MmaTiles(128, 128, 8)}
SIMULATOR_MMA_BACKWARD_TILES = MmaTiles(32, 32, 1, 2)

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def vector_elements(tiles):
    """Head-dim elements per vector copy: 16-byte cp.async chunks (and bulk tensor copies) in the
    tensor-core kernels, 4-element loads in the CUDA-core kernels."""
    return 4 if isinstance(tiles, Tiles) else 8


def accumulator(dtype):
    return "float64" if dtype == "float64" else "float32"


def headdim_bucket(headdim):
    """Compile-time head dimension of the CUDA-core kernels: 32, 64, 128 or 256, the first >= headdim.

    Each bucket is a separate compile of every kernel (a few seconds each); four buckets keep a
    process's compiles few, at the cost of padding (a headdim of 96 computes 128 columns).
    """
    return next(D for D in (32, 64, 128, 256) if headdim <= D)


def mma_headdim_bucket(headdim):
    """Head dimension the tensor-core kernels compile for: 16, 32, 64, 128 or 256, the first >= headdim.

    A multiple of 16 (one mma k-step); small heads get small buckets because every product's cost
    grows with the padded head dim (and on the simulator, so does the count of emulated warp exchanges).
    """
    return next(D for D in MMA_HEADDIMS if headdim <= D)


def uses_tensor_cores(dtype, device):
    """float16 and bfloat16 run on the tensor cores from compute capability 8.0 (mma.sync m16n8k16 with
    bfloat16 needs Ampere), and on the simulator, whose tensor cores are the intrinsics' emulations."""
    return dtype in ("float16", "bfloat16") and (device.simulator or device.compute_capability >= (8, 0))


def uses_wgmma(dtype, device, headdim):
    """The wgmma forward: float16 and bfloat16 on compute capability 9.0 (wgmma needs sm_90a, which
    Blackwell's sm_100 does not run), head dims 33 to 256."""
    return (dtype in ("float16", "bfloat16") and device.compute_capability == (9, 0)
            and WGMMA_MIN_HEADDIM <= headdim <= WGMMA_HEADDIMS[-1])


def uses_wgmma_backward(dtype, device, headdim):
    """The wgmma backward: as the forward (`uses_wgmma`) up to headdim 128, where a warpgroup's 64 x headdim dK
    and dV accumulators still fit its registers; not on the simulator, whose plans keep mma.sync's (the
    tests run the wgmma backward's emulation with `SIMULATOR_WGMMA_BACKWARD_TILES`)."""
    return uses_wgmma(dtype, device, headdim) and headdim <= max(WGMMA_BACKWARD_TILES) and not device.simulator


def check_copy_engine(tiles, aligned):
    """Refuse tiles that copy with the bulk tensor copy engine for inputs it cannot read (``aligned`` False):
    asked for in a plan, or a plan made for other arrays."""
    if isinstance(tiles, WgmmaTiles) and tiles.tma and not aligned:
        raise ValueError(f"{tiles}: the plan copies with the bulk tensor copy engine, which needs q, k, v with a "
                         "contiguous head dim, a multiple of 8, and 16-byte aligned strides; use tiles without tma for "
                         "these inputs")


def _cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Plan:
    """Everything the launches need, and what `explain` and `sim` report.

    ``sram_bytes`` is the on-chip working set of one thread block (shared memory plus the
    register-resident accumulators, scores and row statistics): the SRAM `sim` gives the schedule
    when it counts this plan. ``dq_strategy`` is the backward's: "separate" (a dK/dV pass then a dQ pass) or
    "atomic" (``deterministic=False``: the dK/dV pass adds dQ into a float32 workspace, which a last pass
    rounds), as `sim` names them.
    """

    kernel: str
    reason: str
    direction: str
    dtype: str
    device: str
    batch: int
    nheads: int
    nheads_kv: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    headdim_padded: int
    tiles: Tiles | MmaTiles | WgmmaTiles
    launches: tuple
    sram_bytes: int
    dq_strategy: str = "separate"
    # (launch index, `mods.Mods`) -> `compiled.Kernel`, filled by the launches (`interface._launch`)
    kernels: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def block_m(self):
        return self.tiles.block_m

    @property
    def block_n(self):
        return self.tiles.block_n

    @property
    def dtype_bytes(self):
        return DTYPE_BYTES[self.dtype]

    @property
    def dq_acc_shape(self):
        """The float32 dQ of an atomic plan: (batch, nheads, query rows rounded up to a streamed tile, padded head
        dim); every streamed tile adds whole rows."""
        return (self.batch, self.nheads, -(-self.seqlen_q // self.block_n) * self.block_n, self.headdim_padded)

    @property
    def staged_statistics(self):
        """Whether the backward's workspace is a staged preprocess's ``stats`` (`delta_shape`) instead of D."""
        return self.direction == "backward" and _staged_statistics(self.tiles)

    @property
    def delta_shape(self):
        """The backward's O(N) workspace: D (batch, nheads, seqlen_q), or with `staged_statistics` the base-2 LSE
        and D of query rows padded to whole tiles, (batch, nheads, 2, padded rows)."""
        if self.staged_statistics:
            return (self.batch, self.nheads, 2, _padded_rows(self.seqlen_q, self.tiles))
        return (self.batch, self.nheads, self.seqlen_q)

    def describe(self):
        t = self.tiles
        padded = f" padded to {self.headdim_padded}" if self.headdim_padded != self.headdim else ""
        if isinstance(t, WgmmaTiles) and self.direction == "backward":
            copies = (f"{t.stages}-stage rings filled by a producer warpgroup's bulk tensor copies (TMA) on mbarriers"
                      if t.producer else "two stages filled by every thread's cp.async")
            owner = (f"{t.warpgroups} {'consumer ' if t.producer else ''}warpgroup(s), each owning 64 keys (dK/dV) or "
                     f"64 query rows (dQ), streaming {t.block_n}-row tiles; wgmma m64n{t.block_n}k16 (S and dP, "
                     f"operands in shared memory) and m64n{self.headdim_padded}k16 (dV, dK, dQ, P and dS from "
                     f"registers), float32 accumulators; streamed tiles in {copies}, 128-byte swizzle"
                     + ("; the dQ pass issues each tile's dQ += dS K after the next tile's S and dP, so that it runs "
                        "under that tile's dS" if t.dq_deferred else ""))
        elif isinstance(t, WgmmaTiles):
            copies = ("a producer warpgroup's bulk tensor copies (TMA) on mbarriers" if t.tma else
                      "a producer warpgroup's cp.async on mbarriers" if t.producer else "every thread's cp.async")
            owner = (f"{t.warpgroups} warpgroups, each owning 64 query rows; wgmma m64n{t.block_n}k16 (S = Q K^T, "
                     f"operands in shared memory) and m64n{self.headdim_padded}k16 (O += P V, P from registers), "
                     f"float32 accumulators; K and V in {t.stages}-stage rings filled by {copies}, 128-byte swizzle"
                     + ("; the consumer warpgroups take turns to issue their products on named barriers (ping-pong), "
                        "so one's softmax runs under another's matmuls" if t.pingpong else ""))
        elif isinstance(t, MmaTiles):
            n = t.rows_per_warp
            rows = f"{n} keys (dK/dV) or {n} query rows (dQ)" if self.direction == "backward" else f"{n} query rows"
            owner = f"{t.warps} warps, each owning {rows}; mma.sync m16n8k16, float32 accumulators"
        else:
            owner = (f"each thread owns a {t.thread_m} x {t.thread_n} patch of every score tile"
                     + ("; scores summed, scaled and taken from the row maximum in float64" if t.float64_scores
                        else ""))
        if t.blocks_per_sm > 1:
            owner += (f"; {t.blocks_per_sm} blocks per multiprocessor (launch bounds: {t.entry_registers} registers a "
                      "thread at entry)")
        lines = [
            f"kernel      {self.kernel} ({self.direction}, {self.dtype}) on {self.device}",
            f"why         {self.reason}",
            f"blocks      {t.block_m} x {t.block_n} tiles; headdim {self.headdim}{padded}; {owner}",
        ]
        for launch in self.launches:
            lines.append(f"launch      {launch.kernel}: grid {launch.grid} x {launch.threads} threads, "
                         f"{launch.smem_bytes / 1024:.1f} KiB shared memory")
        return "\n".join(lines)


def _choose(direction, acc, D, acc_bytes, device, smem_of, wide=False):
    if device.simulator:
        return dataclasses.replace(SIMULATOR_TILES, float64_scores=wide)
    fitting = [t for t in SIMT_TILES[(direction, acc)] if max(smem_of(t)) * acc_bytes <= device.smem_per_block
               and D <= MAX_HEADDIM.get((direction, acc, t), D) and not (wide and t in FLOAT64_SCORES_SPILL)]
    if not fitting:
        raise ValueError(f"headdim {D} in {acc} needs more shared memory than {device.name} offers per block "
                         f"({device.smem_per_block} bytes)")
    if direction == "forward":
        fitting = [t for t in fitting if t.thread_cols(D) <= MAX_THREAD_COLS] or fitting
    return dataclasses.replace(fitting[0], float64_scores=wide)


def wgmma_headdim(headdim):
    """The head dim the wgmma kernels pad ``headdim`` (at most 256) to."""
    return next(D for D in WGMMA_HEADDIMS if headdim <= D)


def block_visits_tiles(headdim):
    """``(block_m, block_n)``: the forward tiles at which `make_plan`'s ``block_visits`` counts a block mask's visits
    for ``headdim``, or None where no plan depends on them (`WGMMA_BLOCK_SPARSE_DENSE_VISITS`)."""
    D = wgmma_headdim(headdim)
    return (WGMMA_TILES[D].block_m, WGMMA_TILES[D].block_n) if D in WGMMA_BLOCK_SPARSE_TILES else None


def make_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward=False, device=None, tiles=None,
              aligned=True, packed=False, user_functions=False, deterministic=True, softcap_alone=False,
              block_sparse=False, alibi_alone=False, lse=True, softcap=0.0, block_visits=None):
    """The plan for these sizes on ``device`` (default: the current one). ``tiles`` overrides the blocks.
    ``aligned``: whether q, k and v have a contiguous head dim, a multiple of 8, and 16-byte aligned
    strides, as the bulk tensor copy engine needs (`interface.vector_staging`). ``packed``: a varlen call
    (`numbaflash.varlen`) of ``batch`` sequences, the longest ``seqlen_q`` and ``seqlen_k``, which the
    grid covers. ``user_functions``: the forward calls the user's functions per score
    (`numbaflash.mods.Mods.per_score_functions`); ``softcap_alone``: its scores go through softcap's tanh alone
    (`numbaflash.mods.Mods.softcap_alone`); ``block_sparse``: a block mask's call, whose blocks visit only its
    non-empty tiles, on average ``block_visits`` key tiles a block of `block_visits_tiles` (an int; None: unknown,
    taken as few); ``alibi_alone``: ALiBi without softcap or a score_mod (`numbaflash.mods.Mods.alibi_alone`);
    ``lse``: the caller takes the forward's LSE (``return_lse``, or a backward from it), which the tensor cores' row
    sums do not give exactly (`ROW_SUMS_HEADDIMS`); ``softcap``: the call's softcap (0: off), whose bound on the
    scores a bfloat16 forward with ``softcap_alone`` takes for its maximum (`fixed_maximum`).
    ``deterministic``: a backward whose repeats are bitwise identical; False with v5's ``tiles`` runs its dK/dV
    kernel that accumulates dQ with float32 atomics (`WGMMA_ATOMIC_DQ`), which a plan picks by itself only with
    ``softcap`` (`ATOMIC_DQ_SOFTCAP_REASON`)."""
    device = current_device() if device is None else device
    if block_visits is not None:
        if not block_sparse:
            raise ValueError("block_visits counts a block mask's visits: it is None without block_sparse=True")
        block_visits = arguments.positive_int(block_visits, "block_visits", least=0)
    return _make_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward, device, tiles, aligned,
                      packed, user_functions, deterministic, softcap_alone, block_sparse, alibi_alone, lse, softcap,
                      block_visits)


@functools.lru_cache(maxsize=1024)  # plans are immutable; a model calls attention with few distinct shapes
def _make_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward, device, tiles, aligned, packed,
               user_functions, deterministic, softcap_alone, block_sparse, alibi_alone, lse, softcap, block_visits):
    plan = _choose_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward, device, tiles, aligned,
                        packed, user_functions, deterministic, softcap_alone, block_sparse, alibi_alone, lse, softcap,
                        block_visits)
    if backward and not deterministic and not isinstance(plan.tiles, WgmmaTiles):  # the wgmma plans say their own
        plan = dataclasses.replace(plan, reason=plan.reason + f"; deterministic=False: {plan.kernel} has no atomic "
                                   "dQ, and runs its deterministic passes")
    return plan


def _choose_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k, headdim, dtype, backward, device, tiles, aligned, packed,
                 user_functions, deterministic, softcap_alone, block_sparse, alibi_alone, lse, softcap, block_visits):
    from .kernels.mma import backward as mma_backward
    from .kernels.simt import backward as simt_backward, forward as simt_forward

    shape = dict(batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                 headdim=headdim, dtype=dtype)
    if isinstance(tiles, WgmmaTiles) and (headdim > WGMMA_HEADDIMS[-1] or dtype not in ("float16", "bfloat16")):
        raise ValueError(f"wgmma tiles run float16/bfloat16 with headdim <= {WGMMA_HEADDIMS[-1]}; "
                         f"got {dtype}, headdim {headdim}")
    if backward and isinstance(tiles, WgmmaTiles) and headdim > max(WGMMA_BACKWARD_TILES):
        raise ValueError(f"the wgmma backward runs head dims up to {max(WGMMA_BACKWARD_TILES)}; got headdim {headdim}")
    if uses_tensor_cores(dtype, device) and (tiles is None or isinstance(tiles, (MmaTiles, WgmmaTiles))):
        if backward and (isinstance(tiles, WgmmaTiles) or (tiles is None and uses_wgmma_backward(dtype, device, headdim))):
            return _wgmma_backward_plan(shape, device, tiles, aligned, packed, deterministic, block_sparse,
                                        softcap > 0 and not user_functions and not block_sparse)
        if not backward and (isinstance(tiles, WgmmaTiles) or (tiles is None and uses_wgmma(dtype, device, headdim))):
            return _wgmma_forward_plan(shape, device, tiles, aligned, packed, user_functions, softcap_alone,
                                       block_sparse, alibi_alone, lse, softcap, block_visits)
        if not backward:
            return _mma_forward_plan(shape, device, tiles)
        if headdim <= mma_backward.MAX_HEADDIM:
            return _mma_backward_plan(shape, device, tiles)
    acc = accumulator(dtype)
    acc_bytes = DTYPE_BYTES[acc]
    D = headdim_bucket(headdim)
    direction = "backward" if backward else "forward"
    if backward:
        smem_of = lambda t: (simt_backward.smem_elements_dkdv(D, t), simt_backward.smem_elements_dq(D, t))
    else:
        smem_of = lambda t: (simt_forward.smem_elements(D, t),)
    wide = not backward and dtype == "float32" and (device.simulator or device.compute_capability in FLOAT64_SCORES)
    chosen = tiles or _choose(direction, acc, D, acc_bytes, device, smem_of, wide)
    smem = [n * acc_bytes for n in smem_of(chosen)]
    bm, bn = chosen.block_m, chosen.block_n
    if backward:
        registers = acc_bytes * (2 * bm * D + 2 * bm * bn + 2 * bn)  # dK, dV or dQ accumulators, S and dP
    else:
        score_bytes = 8 if chosen.float64_scores else acc_bytes
        registers = acc_bytes * (bm * D + bm) + score_bytes * (bm * bn + bm)  # O accumulator and l; S and m
    if dtype in ("float16", "bfloat16") and uses_tensor_cores(dtype, device):
        why = ("CUDA-core tiles were requested" if tiles is not None else
               f"headdim {headdim} > {mma_backward.MAX_HEADDIM}: the tensor-core backward keeps a warp's 16 x headdim "
               "dK and dV in registers, which do not fit past 128")
    elif dtype in ("float16", "bfloat16"):
        why = (f"{dtype} needs compute capability 8.0 for the tensor-core kernels; {device.name} has "
               f"{device.compute_capability[0]}.{device.compute_capability[1]}")
    else:
        why = f"{dtype} runs on the CUDA cores (the tensor-core kernels take float16 and bfloat16)"
    if not backward and dtype == "float32":
        scores = ("in float64, rounded once from the row maximum: float32 scores in the thousands are quantized by "
                  "~1e-3" if chosen.float64_scores else "in float32")
        rate = ("the simulator plans as for GPUs that run float64 at half the float32 rate" if device.simulator else
                f"{device.name} runs float64 at {'half' if wide else 'a small fraction of'} the float32 rate")
        why += f"; scores {scores} ({rate})"
    reason = (f"{why}; accumulates in {acc}, head dims padded to 32, 64, 128 or 256"
              + ("; the simulator plan uses small blocks" if device.simulator else ""))
    return _plan("simt_" + direction, reason, shape, device, D, chosen, smem, registers)


def preprocess_grid(seqlen_q, nheads, batch):
    """The backward preprocess's grid (delta = rowsum(dO * O)): one block per PREPROCESS_ROWS query rows of
    each head and batch element (a varlen call's packed rows are one batch element of total_q rows)."""
    from .kernels.simt.backward import PREPROCESS_ROWS

    return (_cdiv(seqlen_q, PREPROCESS_ROWS), nheads, batch)


def _staged_statistics(tiles):
    """Whether a backward of these tiles reads its rows' LSE and D from a staged preprocess's padded ``stats``
    (v5, whose producer copies them in bulk: `wgmma.ws_backward`)."""
    return isinstance(tiles, WgmmaTiles) and tiles.producer


def packed_delta_shape(plan, total_q):
    """The staged statistics of a varlen backward that has them (`Plan.staged_statistics`): ``(1, nheads, 2,
    rows)``, each packed sequence's rows padded to whole tiles from `kernels.sequences.stats_start` on."""
    from .kernels.sequences import stats_start, stats_tile_rows

    return (1, plan.nheads, 2, stats_start(total_q, plan.batch, stats_tile_rows(plan.tiles)))


def _padded_rows(seqlen_q, tiles):
    """Query rows rounded up to whole tiles of both backward passes (the staged ``stats``' last axis)."""
    from .kernels.sequences import stats_tile_rows

    whole = stats_tile_rows(tiles)
    return _cdiv(seqlen_q, whole) * whole


def _plan(kernel, reason, shape, device, D, tiles, smem, registers, dq_strategy="separate"):
    """The `Plan` of ``kernel`` ("simt_forward", "mma_backward", ...) with its launches: one block per query
    block (forward, dQ) or key block (dK/dV) of every head; ``smem`` bytes per launch after the preprocess.
    A backward with ``dq_strategy`` "atomic" runs its key pass ("_dkdvdq", which adds dQ into a float32
    workspace) and then rounds dQ row by row instead of running a query pass."""
    backward = kernel.endswith("backward")
    batch, nheads, nheads_kv = shape["batch"], shape["nheads"], shape["nheads_kv"]
    bm = tiles.block_m
    query_blocks = (_cdiv(shape["seqlen_q"], bm), nheads, batch)
    if backward:
        from .kernels.simt.backward import PREPROCESS_ROWS, STAGED_PREPROCESS_ROWS, STAGED_PREPROCESS_WARPS

        rows = preprocess_grid(shape["seqlen_q"], nheads, batch)
        key_blocks = (_cdiv(shape["seqlen_k"], bm), nheads_kv, batch)
        if _staged_statistics(tiles):
            padded = (_cdiv(_padded_rows(shape["seqlen_q"], tiles), STAGED_PREPROCESS_ROWS), nheads, batch)
            launches = (Launch(kernel + "_preprocess", padded, 32 * STAGED_PREPROCESS_WARPS, 0),)
        else:
            launches = (Launch("simt_backward_preprocess", rows, 32 * PREPROCESS_ROWS, 0),)
        if dq_strategy == "atomic":
            launches += (Launch(kernel + "_dkdvdq", key_blocks, tiles.threads, smem[0]),
                         Launch("backward_dq_postprocess", rows, 32 * PREPROCESS_ROWS, 0))
        else:
            launches += (Launch(kernel + "_dkdv", key_blocks, tiles.threads, smem[0]),
                         Launch(kernel + "_dq", query_blocks, tiles.threads, smem[1]))
    else:
        launches = (Launch(kernel, query_blocks, tiles.threads, smem[0]),)
    return Plan(kernel=kernel, reason=reason, direction="backward" if backward else "forward", device=device.name,
                headdim_padded=D, tiles=tiles, launches=launches, sram_bytes=max(smem) + registers,
                dq_strategy=dq_strategy, **shape)


def _mma_where(device):
    if device.simulator:
        return "the CUDA simulator, whose mma, ldmatrix and cp.async are emulations (one warp per block)"
    return f"compute capability {device.compute_capability[0]}.{device.compute_capability[1]}"


def _check_smem(what, smem, shape, device, tiles):
    # A multiprocessor keeps 1 KiB per block beside what the block may use (`Device.smem_per_block`).
    offered = (device.smem_per_block + 1024) // tiles.blocks_per_sm - 1024
    if max(smem) > offered:
        raise ValueError(f"the tensor-core {what} needs {max(smem)} bytes of shared memory at headdim "
                         f"{shape['headdim']}; {device.name} offers {offered} to each of "
                         f"{tiles.blocks_per_sm} block(s) per multiprocessor")


def _mma_forward_plan(shape, device, tiles, hopper=""):
    """``hopper``: why a Hopper GPU runs mma.sync here (from `_wgmma_forward_plan`), else worked out below."""
    from .kernels.mma import forward as mma_forward

    D = mma_headdim_bucket(shape["headdim"])
    requested = tiles is not None
    tiles = tiles or (SIMULATOR_MMA_TILES if device.simulator else MMA_TILES[D])
    smem = (2 * mma_forward.smem_elements(D, tiles),)
    _check_smem("forward", smem, shape, device, tiles)
    registers = 4 * (tiles.block_m * D + tiles.block_m * tiles.block_n + 2 * tiles.block_m)
    if device.compute_capability == (9, 0) and not requested and not hopper:
        hopper = (f"; headdim {shape['headdim']} < {WGMMA_MIN_HEADDIM}: mma.sync's 16- and 32-wide buckets pad less "
                  "than wgmma's 64")
    reason = (f"{shape['dtype']} on {_mma_where(device)}: tensor cores, float32 accumulation; head dims padded to "
              f"16, 32, 64, 128 or 256{hopper}")
    return _plan("mma_forward", reason, shape, device, D, tiles, smem, registers)


def _wgmma_forward_plan(shape, device, tiles, aligned, packed, user_functions, softcap_alone, block_sparse,
                        alibi_alone, lse, softcap, block_visits):
    from .kernels.wgmma import forward as wgmma_forward, ws_forward as wgmma_ws_forward

    D = wgmma_headdim(shape["headdim"])
    copies = ""
    many_visits = D in WGMMA_BLOCK_SPARSE_TILES and (block_visits or 0) >= WGMMA_BLOCK_SPARSE_DENSE_VISITS
    if tiles is None:
        tiles = (SIMULATOR_WGMMA_TILES if device.simulator else
                 WGMMA_USER_FUNCTION_TILES.get(D, WGMMA_TILES[D]) if user_functions else
                 WGMMA_TILES[D] if many_visits else
                 WGMMA_BLOCK_SPARSE_TILES.get(D, WGMMA_TILES[D]) if block_sparse else
                 WGMMA_SOFTCAP_TILES.get(D, WGMMA_TILES[D]) if softcap_alone else
                 WGMMA_ALIBI_TILES.get(D, WGMMA_TILES[D]) if alibi_alone and not packed else WGMMA_TILES[D])
        if user_functions and D in WGMMA_USER_FUNCTION_TILES and not device.simulator:
            copies = (f"; the user's functions called per score: {tiles.warpgroups} consumer warpgroups, whose "
                      f"registers hold them ({WGMMA_TILES[D].warpgroups} spill them)")
        elif tiles.blocks_per_sm > 1:
            copies = f"; {SHARED_BLOCKS_REASON}"
        elif many_visits:
            copies = (f"; a block mask whose blocks visit {block_visits} key tiles each on average (at least "
                      f"{WGMMA_BLOCK_SPARSE_DENSE_VISITS}): the dense plan's tiles, whose consumers take turns")
        elif tiles.exp2_fma:
            copies = "; softcap's tanh and the softmax's ex2 bound the special-function unit"
        elif tiles.alibi_columns:
            copies = ("; ALiBi alone: one more wgmma k-step adds the bias's column term to each key tile on one side "
                      "of a warpgroup's diagonal, whose scores then take no instruction of their own")
        elif softcap_alone and tiles == WGMMA_SOFTCAP_TILES.get(D):
            copies = f"; {SOFTCAP_CONSUMERS_REASON}"
        cp_async = ("q, k or v has a head dim that is not contiguous, not a multiple of 8 or not 16-byte aligned, "
                    "which the bulk tensor copy engine cannot read" if tiles.tma and not aligned else "")
        if (cp_async or not tiles.producer) and D not in WGMMA_CP_ASYNC_TILES:
            why = cp_async or "the simulator's wgmma plans run v3 (one warpgroup)"
            return _mma_forward_plan(shape, device, None, f"; {why}, and v3 (cp.async) has no headdim-{D} tiles: "
                                                          "mma.sync")
        if cp_async:
            tiles = WGMMA_CP_ASYNC_TILES[D]
            copies = f"; {cp_async}: v3 copies with cp.async"
        elif not lse and (softcap_alone or alibi_alone and not packed) and D in ROW_SUMS_HEADDIMS and tiles.tma:
            tiles = dataclasses.replace(tiles, row_sums=True)
            if tiles.exp2_pairs(shape["dtype"]):
                tiles = dataclasses.replace(tiles, exp2_fma=WGMMA_SOFTCAP_PAIR_CHUNKS[D])
            copies += f"; {ROW_SUMS_REASON}"
        if tiles.exp2_fma:
            pairs = " as float16 pairs" if tiles.exp2_pairs(shape["dtype"]) else ""
            copies += (f"; {tiles.exp2_fma} of {tiles.block_n // 8} 8-key chunks take ex2 from a polynomial on the FMA "
                       f"pipe{pairs}")
        if softcap_alone and fixed_maximum(shape["dtype"], softcap) and tiles.tma:
            tiles = dataclasses.replace(tiles, bounded_max=True)
            copies += f"; {BOUNDED_MAX_REASON}"
    else:
        check_copy_engine(tiles, aligned)
        if tiles.producer and not tiles.tma and packed:
            raise ValueError(f"{tiles}: v4 (a producer without tma) does not take packed (varlen) sequences; v5 "
                             "(tma=True) and v3 (no producer) do")
    smem = ((wgmma_ws_forward if tiles.producer else wgmma_forward).smem_bytes(D, tiles),)
    _check_smem("forward", smem, shape, device, tiles)
    registers = 4 * (tiles.block_m * D + tiles.block_m * tiles.block_n + 2 * tiles.block_m)
    where = ("the CUDA simulator, whose wgmma and cp.async are emulations (one warpgroup per block)" if device.simulator
             else f"compute capability 9.0 ({device.name})")
    reason = (f"{shape['dtype']} on {where}: warpgroup tensor cores (wgmma), float32 accumulation; head dims padded "
              f"to 64, 128 or 256{copies}")
    return _plan(tiles.kernel, reason, shape, device, D, tiles, smem, registers)


def _wgmma_backward_plan(shape, device, tiles, aligned, packed, deterministic, block_sparse, capped):
    """The wgmma backward's plan: v5 (`WGMMA_BACKWARD_TILES`) where the copy engine reads the operands, else
    mma.sync's (`explain` says why); v3 or other tiles when asked for. Not ``deterministic`` with v5's tiles
    asked for, or planned with softcap and no user function or block mask (``capped``): v5 accumulates dQ in its
    dK/dV kernel (`WGMMA_ATOMIC_DQ`)."""
    from .kernels.wgmma import backward as wgmma_backward, ws_backward as wgmma_ws_backward

    D = wgmma_headdim(shape["headdim"])
    planned = tiles is None
    if planned:
        if not aligned:
            return _mma_backward_plan(shape, device, None, "; the wgmma backward (v5) does not run q, k, v or dout "
                                      "with a head dim that is not contiguous, not a multiple of 8 or not 16-byte "
                                      "aligned, which the bulk tensor copy engine cannot read")
        tiles = (WGMMA_BLOCK_SPARSE_BACKWARD_TILES.get(D, WGMMA_BACKWARD_TILES[D]) if block_sparse else
                 WGMMA_BACKWARD_TILES[D])
    if packed and not tiles.producer:
        raise ValueError(f"{tiles}: v3's wgmma backward does not take packed (varlen) sequences; v5's tiles (a producer) "
                         "and mma.sync's do")
    if tiles.producer and not tiles.tma or tiles.pingpong:
        raise ValueError(f"the wgmma backward's producer issues bulk tensor copies (tma=True), without ping-pong; "
                         f"got {tiles}")
    if not tiles.producer and tiles.block_m != tiles.block_n:
        raise ValueError(f"the wgmma backward without a producer takes square tiles (block_m = block_n); got {tiles}")
    if tiles.producer and tiles.warpgroups not in wgmma_ws_backward.REGISTERS:
        raise ValueError(f"the wgmma backward runs 1 or 2 consumer warpgroups beside its producer; got {tiles}")
    check_copy_engine(tiles, aligned)
    atomic = (not deterministic and (capped or not planned) and not packed and tiles.producer
              and tiles.block_n == WGMMA_ATOMIC_DQ and D in WGMMA_ATOMIC_DQ_HEADDIMS)
    kernels = wgmma_ws_backward if tiles.producer else wgmma_backward
    smem = ((wgmma_ws_backward.smem_bytes_dkdv(D, tiles, True), 0) if atomic else
            (kernels.smem_bytes_dkdv(D, tiles), kernels.smem_bytes_dq(D, tiles)))
    _check_smem("backward", smem, shape, device, tiles)
    registers = 4 * (2 * 64 * tiles.warpgroups * D + 2 * tiles.block_m * tiles.block_n)  # dK and dV, S and dP
    where = ("the CUDA simulator, whose wgmma and copies are emulations" if device.simulator
             else f"compute capability 9.0 ({device.name})")
    reason = (f"{shape['dtype']} on {where}: warpgroup tensor cores (wgmma), float32 accumulation; head dims padded "
              f"to 64 or 128; D = rowsum(dO * O) on the CUDA cores")
    if tiles.blocks_per_sm > 1 and planned:
        reason += f"; {SHARED_BLOCKS_REASON}"
    if atomic:
        reason += ("; deterministic=False: the dK/dV kernel also adds dS K into a float32 dQ with atomics (5 products "
                   "per tile pair instead of 7; repeats may differ in the last bits of dQ)"
                   + (f"; {ATOMIC_DQ_SOFTCAP_REASON}" if planned else ""))
    elif not deterministic:
        why = ("they run faster than v5's atomic dQ, which runs with v5's tiles asked for, or planned with softcap "
               "alone or with ALiBi (no score_mod or mask_mod, packed sequences or block mask)"
               if planned and D in WGMMA_ATOMIC_DQ_HEADDIMS else
               f"the atomic dQ runs v5's tiles streaming {WGMMA_ATOMIC_DQ} query rows at head dims padded to "
               f"{', '.join(map(str, WGMMA_ATOMIC_DQ_HEADDIMS))}")
        reason += f"; deterministic=False, but this call runs the deterministic two passes: {why}"
    return _plan("wgmma_tma_backward" if tiles.producer else "wgmma_backward", reason, shape, device, D, tiles, smem,
                 registers, "atomic" if atomic else "separate")


def _mma_backward_plan(shape, device, tiles, hopper=""):
    """``hopper``: why a Hopper GPU runs mma.sync here (from `_wgmma_backward_plan`), else worked out below."""
    from .kernels.mma import backward as mma_backward

    D = mma_headdim_bucket(shape["headdim"])
    planned = tiles is None
    tiles = tiles or (SIMULATOR_MMA_BACKWARD_TILES if device.simulator else MMA_BACKWARD_TILES[D])
    if tiles.block_m != tiles.block_n:
        raise ValueError(f"the tensor-core backward takes square tiles (block_m = block_n); got {tiles}")
    smem = (2 * mma_backward.smem_elements_dkdv(D, tiles), 2 * mma_backward.smem_elements_dq(D, tiles))
    _check_smem("backward", smem, shape, device, tiles)
    chunk = mma_backward.chunk(tiles)
    registers = 4 * (2 * tiles.block_m * D + 2 * tiles.block_m * chunk)  # dK and dV fragments, S and dP of a chunk
    reason = (f"{shape['dtype']} on {_mma_where(device)}: tensor cores, float32 accumulation; head dims padded to "
              f"16, 32, 64 or 128; score tiles in chunks of {chunk} columns; D = rowsum(dO * O) on the CUDA cores"
              + (hopper or (f"; the wgmma backward starts at headdim {WGMMA_MIN_HEADDIM}"
                            if device.compute_capability == (9, 0) and planned and not device.simulator else "")))
    return _plan("mma_backward", reason, shape, device, D, tiles, smem, registers)
