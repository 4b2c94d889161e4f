"""ALiBi's column term from the tensor cores: one bfloat16 wgmma k-step before a tile's S = Q K^T (v5's forward).

On a key tile wholly on one side of a warpgroup's 64-row diagonal (`kernels.mods.alibi_columns_side`) ALiBi's
bias -slope |row + seqlen_k - seqlen_q - key| is a row term plus a column term, -slope side c for the key's
column c in the tile. The softmax adds the row term to each row's maximum and exponent
(`kernels.softmax`'s ``shift``). The column term is the same for every row: a rank-1 product, which one more
k-step writes into S before Q K^T's k-steps add onto it. Its A is 64 rows of (1, 1, 1, 0, ...), its B has
for key c the three bfloat16 whose sum is -gamma c exactly (the float32 split in three 8-bit pieces by
truncation), and, 16 columns on, those of +gamma c: the tile's side picks one by the descriptor. Scores are
then in units of softmax_scale (gamma = slope / softmax_scale, `kernels.mods.alibi_columns_units`), so the
softmax's exponent FMA scales them as the plain kernel's does: a one-sided tile's scores take no instruction
of their own, where each took an FFMA (``s * scale - slope side 8 j``) beside a tile's column products and
int64-to-float conversions. A tile across the diagonal keeps its per-score bias: its descriptor picks B's third
k-step, zeros (a first Q K^T k-step that overwrote S where a predicate said so cost 1.5%, ncu, H100).

Measured (fp16, headdim 64, N = 16384, 16 heads, stream timing, three paired runs, ``.bench/alibi_ab.py``;
ALiBi's forward over the plain one's): a stand-in with wrong numbers (no per-score work, a k-step of Q and K)
1.05-1.06x against 1.12-1.13x on the H100, which decided it; built, 1.05-1.09x against 1.10-1.12x (H100), and
with `key_tiles.tile_order`'s order 1.08-1.10x against 1.12x, causal 1.08-1.10x against 1.13-1.15x (H200).
Instructions (ncu, N = 8192): 370.6 M -> 341.4 M, the plain forward's 289 M. At headdim 128 a first build ran
1-3% slower than without (H100), so `tiling.WGMMA_ALIBI_TILES` keeps it to 64.
"""

import numpy as np
from numba import types

from ..intrinsics import bits_float, device_function, float_bits, wgmma_ss
from .tiles import ATOM, ATOM_ROWS, advance

ONES = np.uint64(0x3F803F803F80)  # bfloat16 (1, 1, 1, 0) in a word's four elements
HIGH_HALF = np.uint32(0xFFFF0000)
K_STEP = 16  # columns of one k-step: B's -gamma c pieces, then its +gamma c pieces, then zeros


def elements(block_n):
    """16-bit elements of the two operands in shared memory: A's 64 rows and B's ``block_n``, a swizzle atom each
    (only the first three k-steps' columns are written and read)."""
    return (64 + block_n) * ATOM


@device_function
def piece(x, k):
    """Piece ``k`` (0, 1, 2) of ``x`` as bfloat16 bits: the top 8 significant bits, the next 8 of the rest, and what
    is left, each exact, so the three sum to ``x``."""
    hi = bits_float(float_bits(x) & HIGH_HALF)
    rest = x - hi
    mid = bits_float(float_bits(rest) & HIGH_HALF)
    part = hi if k == 0 else mid if k == 1 else rest - mid
    return np.uint16(float_bits(part) >> np.uint32(16))


def column_bias(BLOCK_N):
    """``(fill, add)`` for tiles of ``BLOCK_N`` keys:

    * ``fill(words, at, gamma, tid, threads)``: the block's threads write A and B at 16-bit element ``at`` of
      shared memory (swizzled as `wgmma.tiles` lays out K-major operands), through ``words``, the same memory as
      8-byte words; the caller fences them for the async proxy before a barrier;
    * ``add(s, smem, desc, side)``: the warpgroup's 64 x ``BLOCK_N`` scores overwritten with side's column term
      (``side`` -1 reads B's second k-step, 0 its third, zeros), ``desc`` a K-major descriptor of A
      (`tiles.operand`; B follows it); the caller then adds Q K^T onto them (`tiles.products`' ``onto``)."""
    CHUNKS = 3 * K_STEP // 8  # 16-byte chunks of a row that the three k-steps read
    ROWS = 64 + BLOCK_N  # A's, then B's
    step = wgmma_ss(BLOCK_N, "bfloat16", fresh=True)

    @device_function
    def fill(words, at, gamma, tid, threads):
        # One 16-byte chunk (two words) a thread: a chunk element by element took each thread 8 stores and the
        # pieces' arithmetic per element.
        for e in range(tid, ROWS * CHUNKS, threads):
            row, chunk = e // CHUNKS, e % CHUNKS
            low = np.uint64(0)
            if chunk == 0 or chunk == 2:  # (1, 1, 1) in A's first k-step; (hi, mid, lo) of -gamma c, then of
                # +gamma c, in B's first two
                if row < 64:
                    low = ONES if chunk == 0 else np.uint64(0)
                else:
                    bias = gamma * types.float32(row - 64) * types.float32(1 if chunk == 2 else -1)
                    low = (np.uint64(piece(bias, 0)) | (np.uint64(piece(bias, 1)) << np.uint64(16))
                           | (np.uint64(piece(bias, 2)) << np.uint64(32)))
            word = (at + row * ATOM + (chunk ^ (row % ATOM_ROWS)) * 8) // 4
            words[word] = low
            words[word + 1] = np.uint64(0)

    @device_function
    def add(s, smem, desc, side):
        # A K-major descriptor's fields but the address are the same for any rows (`tiles.operand`): B's is A's
        # moved past A's atom, and then to the side's k-step (+1: -gamma c, -1: +gamma c, 0: zeros).
        k_step = 0 if side > 0 else 1 if side < 0 else 2
        step(s, smem, desc, advance(desc, 2 * 64 * ATOM + 2 * K_STEP * k_step), 0)

    return fill, add
