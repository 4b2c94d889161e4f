"""Building blocks of the tensor-core kernels: staging 16-bit tiles with cp.async, and warp-level products.

Every product in the tensor-core forward and backward has one of two shapes, for a warp that owns M
m-tiles (16 M consecutive rows) of its left operand:

* `products` -> ``scores(s, a, smem, a_at, b_at)``: ``s = A B^T``, a 16 M x N tile of float32
  accumulators, with A's rows and B's N rows both in shared memory and the head dimension D contracted
  (S = Q K^T, dP = dO V^T, and their transposes S^T = K Q^T, dP^T = V dO^T in the dK/dV kernel).
  A comes through ldmatrix as the A operand, B's rows through ldmatrix as the B operand's columns.
* ``accumulate(acc, p, a, smem, b_at)``: ``acc += P B``, 16 M x D, where P (16 M x N) is a `scores`
  tile in registers, rounded to 16 bits and repacked as the A operand (the accumulators of two n-tiles
  are exactly the A fragment of one k-step), and B's N rows of D come through ldmatrix.trans
  (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q).

``a`` is the caller's (M, 4) uint32 scratch for the A fragments (a device function cannot allocate a
local array under the simulator).
Tiles sit in shared memory row-major with rows padded by 8 halves (16 bytes), so the 8 rows one
ldmatrix reads fall in distinct banks. ``lane_offsets`` gives each lane's ldmatrix row address for
the three ways an operand is read; callers add it to a tile's base once.

Sizes are compile-time constants; once NVVM inlines these functions, the fragment arrays a kernel
passes in are indexed by constants only and stay in registers.
"""

from numba import types

from ..intrinsics import (cp_async_16, device_function, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16, mma_f16, pack_bf16,
                         pack_f16)
from ..fragments import fill


def row_stride(D):
    """Halves per shared-memory row of a D-wide tile: 16 bytes of padding against bank conflicts."""
    return D + 8


@device_function
def lane_offsets(lane, ld):
    """Each lane's ldmatrix row address (in halves, relative to a tile's first row) when the tile is read
    as the A operand, as the B operand of ``A B^T`` (two n-tiles per ldmatrix), and as the B operand
    of ``P B`` through ldmatrix.trans. Lane l serves row l % 8 of matrix l // 8."""
    a = (lane % 16) * ld + (lane // 16) * 8  # matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
    b = (lane % 8 + (lane // 16) * 8) * ld + ((lane // 8) % 2) * 8  # (n-tile 0 | 1) x (k 0-7 | 8-15)
    t = (lane % 8 + ((lane // 8) % 2) * 8) * ld + (lane // 16) * 8  # (k 0-7 | 8-15) x (n 0-7 | 8-15)
    return a, b, t


def stager(D, THREADS):
    """``stage(smem, at, src, b, row0, h, rows, tid, vec)``: rows ``row0 ..`` of head ``h`` of a 4-D
    (batch, seqlen, heads, headdim) array of 16-bit words into shared memory at ``at`` (row stride
    `row_stride`), zeros past the sequence or the head dim.

    With ``vec`` (head dim a multiple of 8, 16-byte aligned rows) every 16-byte chunk is one cp.async
    that lands while the warps compute, and the caller commits and waits; otherwise element by
    element, synchronously.
    """
    LD, CHUNKS = row_stride(D), D // 8

    @device_function
    def stage(smem, at, src, b, row0, h, rows, tid, vec):
        if vec:
            for e in range(tid, rows * CHUNKS, THREADS):
                i = e // CHUNKS
                col = (e - i * CHUNKS) * 8
                ok = row0 + i < src.shape[1] and col < src.shape[3]
                # An empty copy still needs an address; row 0, column 0 always exists.
                cp_async_16(smem, at + i * LD + col, src, (b, row0 + i if ok else 0, h, col if ok else 0),
                            16 if ok else 0)
        else:
            for e in range(tid, rows * D, THREADS):
                i = e // D
                col = e - i * D
                x = types.uint16(0)
                if row0 + i < src.shape[1] and col < src.shape[3]:
                    x = src[b, row0 + i, h, col]
                smem[at + i * LD + col] = x

    return stage


def products(N, D, storage, M=1):
    """``(scores, accumulate)`` for a warp that owns ``M`` m-tiles (16 M consecutive rows of its left
    operand), with 16 M x N score tiles over head dim D, in float16 or bfloat16.

    A warp's fragments of m-tile ``i`` are rows ``i * N / 8 ..`` of its score arrays and ``i * D / 8 ..``
    of its accumulators. Every B fragment read from shared memory feeds the M m-tiles' mma: at M = 2 a
    warp reads half as many B bytes per mma, which is what bounds these products at M = 1 (one
    512-byte ldmatrix.x4 takes about as long as the two mma it feeds).
    """
    LD, NT, KS, PS, DT = row_stride(D), N // 8, D // 16, N // 16, D // 8
    mma, pack = (mma_f16, pack_f16) if storage == "float16" else (mma_bf16, pack_bf16)
    ZERO = types.float32(0)

    @device_function
    def mma_into(c, row, a, mi, b0, b1):
        c[row, 0], c[row, 1], c[row, 2], c[row, 3] = mma(
            a[mi, 0], a[mi, 1], a[mi, 2], a[mi, 3], b0, b1, c[row, 0], c[row, 1], c[row, 2], c[row, 3])

    @device_function
    def scores(s, a, smem, a_at, b_at):
        # s: (M * N / 8, 4) fragments; a: (M, 4) uint32 scratch for the m-tiles' A fragments of a k-step;
        # a_at, b_at: tile bases plus the lane's A and B offsets
        fill(s, M * NT, 4, ZERO)
        for kk in range(KS):
            for mi in range(M):
                a[mi, 0], a[mi, 1], a[mi, 2], a[mi, 3] = ldmatrix_x4(smem, a_at + mi * 16 * LD + kk * 16)
            for jp in range(NT // 2):
                b0, b1, b2, b3 = ldmatrix_x4(smem, b_at + jp * 16 * LD + kk * 16)
                for mi in range(M):
                    mma_into(s, mi * NT + 2 * jp, a, mi, b0, b1)
                    mma_into(s, mi * NT + 2 * jp + 1, a, mi, b2, b3)

    @device_function
    def accumulate(acc, p, a, smem, b_at):
        # acc: (M * D / 8, 4) fragments; p: scores-shaped; a: (M, 4) uint32 scratch for P's A fragments;
        # b_at: tile base plus the lane's .trans offset
        for ks in range(PS):
            for mi in range(M):
                j = mi * NT + 2 * ks
                a[mi, 0] = pack(p[j, 0], p[j, 1])
                a[mi, 1] = pack(p[j, 2], p[j, 3])
                a[mi, 2] = pack(p[j + 1, 0], p[j + 1, 1])
                a[mi, 3] = pack(p[j + 1, 2], p[j + 1, 3])
            for dp in range(DT // 2):
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, b_at + ks * 16 * LD + dp * 16)
                for mi in range(M):
                    mma_into(acc, mi * DT + 2 * dp, a, mi, b0, b1)
                    mma_into(acc, mi * DT + 2 * dp + 1, a, mi, b2, b3)

    return scores, accumulate
