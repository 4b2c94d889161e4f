"""Building blocks of the wgmma kernels: swizzled tiles in shared memory, their descriptors, the two products.

Tiles sit in shared memory in wgmma's 128-byte-swizzle layout: a tile of ``rows`` rows of ``D`` 16-bit
elements is ``D / 64`` atoms of ``rows`` x 64 elements (128 bytes a row), atom after atom, and within
an atom the 16-byte chunk ``c`` of row ``i`` sits at chunk ``c ^ (i % 8)``. The hardware applies that XOR
to address bits 4-6 from bits 7-9, so every atom starts on a 1024-byte boundary (`aligned_base`). The
same tile serves as a K-major operand (Q and K in ``S = Q K^T``: rows along M or N, the head dim along
K) and as an MN-major one (V in ``O += P V``: keys along K, the head dim along N), so K and V are
staged alike, straight from global memory with cp.async, without a transpose and without bank conflicts.

* `stager` -> ``stage(smem, at, src, b, row0, h, tid, vec)``: rows ``row0 ..`` of head ``h`` into a
  swizzled tile at element ``at`` (zeros past the sequence or the head dim).
* `descriptor(address, leading, stride)`: the 64-bit shared-memory matrix descriptor; `advance` moves one;
  `operand` is a whole tile's, K-major or MN-major.
* `products` -> ``scores(s, smem, a_desc, b_desc)``: ``S = A B^T`` for a warpgroup's 64 rows of A (D
  contracted, ``D / 16`` wgmma), and ``accumulate(acc, p, smem, b_desc)``: ``acc += P B`` with P from
  registers (``N / 16`` wgmma); `pack_p` rounds a score tile into P's A fragments.
"""

import numpy as np

from ..intrinsics import (cp_async_16, device_function, ex2_fma_f16x2, pack_bf16, pack_f16, shared_address, wgmma_rs,
                          wgmma_ss)
from ..softmax import fma_chunk

ATOM = 64  # elements per row of a swizzle atom (128 bytes)
ATOM_ROWS = 8  # rows per swizzle period (1024 bytes)
ALIGN = 1024  # bytes: atoms start on swizzle periods
SWIZZLE_128B = np.uint64(1) << np.uint64(62)


@device_function
def aligned_base(smem):
    """The first element of a 16-bit shared array whose address is a multiple of `ALIGN` bytes."""
    start = shared_address(smem, 0)
    return ((start + ALIGN - 1) // ALIGN * ALIGN - start) // 2


@device_function
def descriptor(address, leading, stride):
    """Matrix descriptor of a 128-byte-swizzled operand at shared ``address`` (bytes): ``leading`` bytes
    between atoms along an MN-major operand's N (unused by K-major ones), ``stride`` between 8-row groups."""
    return (np.uint64((address >> 4) & 0x3FFF) | (np.uint64(leading >> 4) << np.uint64(16))
            | (np.uint64(stride >> 4) << np.uint64(32)) | SWIZZLE_128B)


@device_function
def advance(desc, nbytes):
    """``desc`` moved ``nbytes`` (a multiple of 16) further into shared memory."""
    return desc + np.uint64(nbytes >> 4)


@device_function
def operand(address, at, rows, mn_major):
    """The descriptor of a swizzled tile of ``rows`` rows at element ``at`` past shared ``address`` (bytes):
    K-major, or MN-major (its atoms ``rows`` rows apart along the head dim, wgmma's N)."""
    period = ATOM_ROWS * ATOM * 2  # bytes between 8-row groups of a swizzled tile
    return descriptor(address + 2 * at, rows * ATOM * 2 if mn_major else 0, period)


@device_function
def descriptors(address, q_at, k_at, v_at, block_n, wg):
    """``(q, k, v)`` descriptors of the forward's tiles at shared ``address`` (bytes) + element offsets: warpgroup
    ``wg``'s 64 rows of the Q tile and the first stage of K and V (``block_n`` rows), K-major
    Q and K, MN-major V."""
    return (operand(address, q_at + wg * 64 * ATOM, 64, False), operand(address, k_at, block_n, False),
            operand(address, v_at, block_n, True))


def stager(D, ROWS, THREADS):
    """``stage(smem, at, src, b, row0, h, tid, vec)`` for tiles of ``ROWS`` rows of head dim ``D`` (a multiple
    of 64). With ``vec`` (head dim a multiple of 8, 16-byte aligned rows) each 16-byte chunk is one
    cp.async and the caller commits and waits; otherwise element by element, synchronously."""
    CHUNKS = D // 8
    COPIES = (ROWS * CHUNKS + THREADS - 1) // THREADS  # 16-byte copies per thread

    @device_function
    def stage(smem, at, src, b, row0, h, tid, vec):
        if vec:
            # A constant trip count, so the loop unrolls and each copy's addresses are base + constants.
            for it in range(COPIES):
                e = tid + it * THREADS
                i = e // CHUNKS
                c = e - i * CHUNKS
                if e < ROWS * CHUNKS:
                    ok = row0 + i < src.shape[1] and 8 * c < src.shape[3]
                    dst = at + (c // 8) * ROWS * ATOM + i * ATOM + ((c % 8) ^ (i % ATOM_ROWS)) * 8
                    # An empty copy still needs an address; row 0, column 0 always exists.
                    cp_async_16(smem, dst, src, (b, row0 + i if ok else 0, h, 8 * c if ok else 0), 16 if ok else 0)
        else:
            for e in range(tid, ROWS * D, THREADS):
                i = e // D
                col = e - i * D
                c = col // 8
                x = np.uint16(0)
                if row0 + i < src.shape[1] and col < src.shape[3]:
                    x = src[b, row0 + i, h, col]
                smem[at + (c // 8) * ROWS * ATOM + i * ATOM + ((c % 8) ^ (i % ATOM_ROWS)) * 8 + col % 8] = x

    return stage


def products(N, D, A_ROWS, B_ROWS, storage, fresh=False, onto=False):
    """``(scores, accumulate)`` for a warpgroup: ``scores`` multiplies its 64 rows of an ``A_ROWS``-row
    tile by the ``N`` rows of a ``B_ROWS``-row tile (both of head dim D); ``accumulate`` adds ``P B`` for P
    (64 x N, in registers) and the N x D tile B. Descriptors point at the first row (of the warpgroup's
    rows, for A) of the tile's first atom. ``fresh``: the scores' old values are no input of their first
    k-step (`wgmma_ss`), so a loop does not carry them from one tile to the next. ``onto``: the first k-step adds
    onto ``s`` too (a term an earlier wgmma of the same group wrote: `alibi_columns`)."""
    KS, PS = D // 16, N // 16
    FRESH, FIRST_ADDS = fresh, int(onto)
    first, ss, rs = wgmma_ss(N, storage, fresh=True), wgmma_ss(N, storage), wgmma_rs(D, storage)
    ATOM_A, ATOM_B, K_STEP = A_ROWS * ATOM * 2, B_ROWS * ATOM * 2, 32  # bytes

    @device_function
    def scores(s, smem, a_desc, b_desc):
        # s: (N / 8, 4) fragments. A k-step is 16 columns (32 bytes) of an atom; 4 k-steps fill one; the
        # first overwrites s unless ``onto`` (a flag of 0 turns accumulation off). One loop over every k-step:
        # the v5 forward at headdim 256 with the first issued before a loop over the rest kept that loop (15
        # k-steps) rolled, and ptxas waited for each product (24 wgmma waits, half the speed: H200).
        for kk in range(KS):
            step = (kk // 4) * ATOM_A + (kk % 4) * K_STEP
            if FRESH and kk == 0:
                first(s, smem, a_desc, b_desc, 0)
            else:
                ss(s, smem, advance(a_desc, step), advance(b_desc, (kk // 4) * ATOM_B + (kk % 4) * K_STEP),
                   kk if kk != 0 else FIRST_ADDS)

    @device_function
    def accumulate(acc, p, smem, b_desc):
        # acc: (D / 8, 4) fragments; p: (N / 16, 4) A words. A k-step is 16 rows (2 swizzle periods) of B.
        for ks in range(PS):
            rs(acc, p[ks, 0], p[ks, 1], p[ks, 2], p[ks, 3], smem, advance(b_desc, ks * 16 * ATOM * 2))

    return scores, accumulate


def pack_p(N, storage, fma_pairs=0):
    """``pack(p, s)``: the (N / 8, 4) float32 fragments ``s`` rounded to 16 bits as P's (N / 16, 4) A words
    (the accumulators of two 8-column chunks are exactly the A fragment of one 16-key k-step); the ``fma_pairs``
    chunks (`kernels.softmax.fma_chunk`) hold base-2 exponents, whose exponentials come as float16 pairs from the
    FMA pipe (`ex2_fma_f16x2`)."""
    pack = pack_f16 if storage == "float16" else pack_bf16

    @device_function
    def word(s, j, half):
        if fma_chunk(j, N // 8, fma_pairs):
            return ex2_fma_f16x2(s[j, 2 * half], s[j, 2 * half + 1])
        return pack(s[j, 2 * half], s[j, 2 * half + 1])

    @device_function
    def pack_words(p, s):
        for ks in range(N // 16):
            p[ks, 0] = word(s, 2 * ks, 0)
            p[ks, 1] = word(s, 2 * ks, 1)
            p[ks, 2] = word(s, 2 * ks + 1, 0)
            p[ks, 3] = word(s, 2 * ks + 1, 1)

    return pack_words
