"""Register fragments every kernel family shares: filling them, and the tensor cores' accumulator layout.

mma.sync m16n8k16 and wgmma m64nNk16 lay a warp's accumulators out alike: lane ``4 g + t`` holds rows
``g`` and ``g + 8`` of each 16-row m-tile and, in every 8-column chunk ``j``, columns ``8 j + 2 t`` and
``+ 1`` (``acc[mi * N / 8 + j, 2 half + e]``). `lane_row` and `fragment_writer` serve both families.
"""

from numba import types

from .intrinsics import device_function, pack_bf16, pack_f16, store2, store2_row


@device_function
def fill(acc, rows, cols, value):
    for i in range(rows):
        for j in range(cols):
            acc[i, j] = value


@device_function
def lane_row(r, g):
    """The row, among a warp's 16 M, of a lane's fragment row ``r`` (0 .. 2 M - 1): rows ``g`` and ``g + 8`` of
    each m-tile, as the accumulator layout of m16n8k16 places them (lane ``4 g + t``)."""
    return 16 * (r // 2) + g + 8 * (r % 2)


@device_function
def rows_aligned(strides):
    """Whether each row of a (batch, seqlen, heads, headdim) array of 16-bit elements with byte ``strides``, its
    first element 4-byte aligned (as the library allocates its outputs), starts 4-byte aligned: where `store2`
    may write its column pairs (the kernels' `fragment_writer` and `sim.hardware`'s model of it ask this)."""
    return strides[0] % 4 == 0 and strides[1] % 4 == 0 and strides[2] % 4 == 0 and strides[3] == 2


def fragment_writer(D, storage, paired=True):
    """``write(dst, b, row0, h, acc, mi, scale_g, scale_g8, g, t)``: m-tile ``mi``'s 16 x D fragments (rows
    ``mi * D / 8 ..`` of ``acc``), rows ``g`` and ``g + 8`` times ``scale_g`` and ``scale_g8``, rounded to
    16 bits, into rows ``row0 + g`` and ``row0 + g + 8`` of head ``h`` (rows past the sequence and
    columns past the head dim are dropped). Each lane holds two adjacent columns per 8-column n-tile, which
    ``paired`` writes in one 4-byte store where the rows are 4-byte aligned (`intrinsics.store2`)."""
    DT = D // 8
    PAIRED = paired
    # Each store computing its own address and testing its columns took 543 instructions a consumer warp to write
    # v5's forward output at headdim 64 (192 x 96 blocks, one key tile a block; ncu, H200), what a key tile's scores
    # and softmax take. At 256 the second loop over the row's 32 pairs left the accumulators' indices unknown to LLVM,
    # which put them in 512 bytes of local memory (ptxas 13.0), so there every store tests its columns.
    WHOLE_ROWS = D <= 128
    pack = pack_f16 if storage == "float16" else pack_bf16

    @device_function
    def pair(acc, i, half, scale):
        word = pack(acc[i, 2 * half] * scale, acc[i, 2 * half + 1] * scale)
        return types.uint16(word & 0xFFFF), types.uint16(word >> 16)

    @device_function
    def write(dst, b, row0, h, acc, mi, scale_g, scale_g8, g, t):
        # A lane's column pair in one 4-byte store where every row is 4-byte aligned (`rows_aligned`: with an even
        # head dim, a varlen sequence's rows too). Two 2-byte stores, each behind its own bound test: the v5 forward
        # at headdim 128 and N = 1024 took 0.349-0.352 ms against 0.310-0.317 (H100, two paired runs).
        # `WHOLE_ROWS`: where the head dim is the padded one every pair lands in the row, so no column is tested and
        # a row's stores take immediate offsets from one address (`store2_row`).
        aligned = PAIRED and rows_aligned(dst.strides)
        whole = WHOLE_ROWS and aligned and dst.shape[3] == D
        for half in range(2):
            row = row0 + g + 8 * half
            scale = scale_g8 if half else scale_g
            if row < dst.shape[1]:
                if whole:
                    for j in range(DT):
                        lo, hi = pair(acc, mi * DT + j, half, scale)
                        store2_row(dst, (b, row, h), 8 * j + 2 * t, lo, hi)
                else:
                    for j in range(DT):
                        col = 8 * j + 2 * t
                        lo, hi = pair(acc, mi * DT + j, half, scale)
                        if aligned and col + 1 < dst.shape[3]:
                            store2(dst, (b, row, h, col), lo, hi)
                        else:
                            if col < dst.shape[3]:
                                dst[b, row, h, col] = lo
                            if col + 1 < dst.shape[3]:
                                dst[b, row, h, col + 1] = hi

    return write
