"""Building blocks of the CUDA-core kernels: staging tiles in shared memory, and register-tiled products.

Every matrix product in the forward and backward kernels has one shape: a thread accumulates a small
patch ``acc[i, j] += sum_k A[k][i] * B[k][j]`` where both operands sit in shared memory with the
contraction index k outermost ("k-major"). A thread's A entries for one k are contiguous (its rows),
so they come in one vector load; its B entries are ``N_GROUPS`` vectors of ``N_VEC`` elements spaced
``N_STRIDE`` apart, so a quarter warp reads 128 contiguous bytes of a B row (no bank conflicts).

The helpers are factories: their sizes are compile-time constants, so once NVVM inlines them into the
kernels a patch is indexed by constants only and stays in registers.
"""

from ..fragments import fill
from ..intrinsics import device_function, load2, load4


@device_function
def _load1(arr, index):
    return (arr[index],)


def patch(n):
    """Device function returning ``arr[index : index + n]`` as a tuple: one vector load for n = 2 or 4."""
    return {1: _load1, 2: load2, 4: load4}[n]


def vector_width(count, acc_bytes):
    """The widest vector (4, 2 or 1 elements, at most 16 bytes) that divides ``count``."""
    for width in (4, 2):
        if count % width == 0 and width * acc_bytes <= 16:
            return width
    return 1


def outer_product(M_PER, N_VEC, N_GROUPS, N_STRIDE, PRODUCT=None):
    """``accumulate(acc, a, a_base, lda, b, b_base, ldb, depth)`` for an ``M_PER x (N_GROUPS*N_VEC)`` patch.

    Row i of the patch is ``a[a_base + k*lda + i]``; column ``g*N_VEC + j`` is
    ``b[b_base + k*ldb + g*N_STRIDE + j]``; k runs over ``depth``, a multiple of 4 (head dimensions are
    padded to multiples of 32, blocks are multiples of 16).

    Four k steps per loop iteration, written out: NVVM would not unroll a loop over them (the body is
    past its threshold), and rolled, each k step spent as many instructions on 64-bit address
    arithmetic and the loop counter as on FMAs. Written out, the addresses are base + constants.
    ``PRODUCT`` (a numba type): the type each product is formed in, the accumulator's where it is wider than the
    operands (float32 operands into float64 scores: the products exact); None: the operands'.
    """
    load_a, load_b = patch(M_PER), patch(N_VEC)
    if PRODUCT is None:
        @device_function
        def widen(x):
            return x
    else:
        @device_function
        def widen(x):
            return PRODUCT(x)

    @device_function
    def step(acc, a, ia, b, ib):
        av = load_a(a, ia)
        for g in range(N_GROUPS):
            bv = load_b(b, ib + g * N_STRIDE)
            for i in range(M_PER):
                for j in range(N_VEC):
                    acc[i, g * N_VEC + j] += widen(av[i]) * widen(bv[j])

    @device_function
    def accumulate(acc, a, a_base, lda, b, b_base, ldb, depth):
        for k in range(0, depth, 4):
            ia, ib = a_base + k * lda, b_base + k * ldb
            step(acc, a, ia, b, ib)
            step(acc, a, ia + lda, b, ib + ldb)
            step(acc, a, ia + 2 * lda, b, ib + 2 * ldb)
            step(acc, a, ia + 3 * lda, b, ib + 3 * ldb)

    return accumulate


def stagers(ROWS, D, THREADS, ZERO, to_acc):
    """``(transposed, natural)`` device functions that copy ``ROWS`` rows of one head into shared memory.

    ``transposed(dst, ld, src, b, row0, h, scale, tid, vec)`` writes
    ``dst[kk*ld + i] = scale * src[b, row0+i, h, kk]`` (k-major, for products that contract over the
    head dimension); ``natural`` writes ``dst[i*ld + kk]``. Rows past the sequence and columns past the
    head dimension are zero. Consecutive threads take consecutive head-dimension elements, so the
    global reads coalesce; with ``vec`` (the launch checked that the head dimension is contiguous, a
    multiple of 4 and 16-byte aligned) each thread reads 4 elements in one vector load.
    """

    def stage(dst, ld, src, b, row0, h, scale, tid, vec, transpose):
        if vec:
            for e in range(tid, ROWS * D // 4, THREADS):
                i = e // (D // 4)
                kk = (e - i * (D // 4)) * 4
                if row0 + i < src.shape[1] and kk < src.shape[3]:
                    x = load4(src, (b, row0 + i, h, kk))
                    for j in range(4):
                        dst[(kk + j) * ld + i if transpose else i * ld + kk + j] = to_acc(x[j]) * scale
                else:
                    for j in range(4):
                        dst[(kk + j) * ld + i if transpose else i * ld + kk + j] = ZERO
        else:
            for e in range(tid, ROWS * D, THREADS):
                i = e // D
                kk = e - i * D
                x = ZERO
                if row0 + i < src.shape[1] and kk < src.shape[3]:
                    x = to_acc(src[b, row0 + i, h, kk]) * scale
                dst[kk * ld + i if transpose else i * ld + kk] = x

    def transposed(dst, ld, src, b, row0, h, scale, tid, vec):
        stage(dst, ld, src, b, row0, h, scale, tid, vec, True)

    def natural(dst, ld, src, b, row0, h, scale, tid, vec):
        stage(dst, ld, src, b, row0, h, scale, tid, vec, False)

    device_function(stage)
    return device_function(transposed), device_function(natural)


def in_parts(product, CHUNK):
    """``run(acc, part, rows, cols, a, a_base, lda, b, b_base, ldb, depth)``: acc += ``product`` over depth as
    a two-level sum: each CHUNK-deep slice into ``part`` (zeroed), then into acc (see `add_tile`).

    The gradients sum one key or query tile at a time (CHUNK = the tile); the scores sum 32 head
    dimensions at a time: over 256 of them in one register, the rounding put a float64 kernel just
    past twice NumPy's error at headdim 200.
    """

    def run(acc, part, rows, cols, a, a_base, lda, b, b_base, ldb, depth):
        for d0 in range(0, depth, CHUNK):
            fill(part, rows, cols, 0.0)
            product(part, a, a_base + d0 * lda, lda, b, b_base + d0 * ldb, ldb, CHUNK)
            add_tile(acc, part, rows, cols)

    return device_function(run)


def patch_writer(TD, VV, COLS_T, from_acc):
    """``write(dst, b, row, h, acc, a, scale, c)``: row ``a`` of a thread's accumulator patch, times ``scale``,
    to ``dst[b, row, h, :]``; the thread's columns are VV-wide vectors COLS_T * VV apart (as the
    products lay them out), and columns past the head dimension are not written."""

    def write(dst, b, row, h, acc, a, scale, c):
        for g in range(TD // VV):
            for x in range(VV):
                col = g * COLS_T * VV + c * VV + x
                if col < dst.shape[3]:
                    dst[b, row, h, col] = from_acc(acc[a, g * VV + x] * scale)

    return device_function(write)


@device_function
def add_tile(acc, tile, rows, cols):
    """acc += tile: the second level of a two-level sum.

    Summing a long reduction (all keys of a row) into one float32 register lets its rounding error grow
    with the sequence: at N = 4096 the output error was 4x naive attention's (NumPy emulation of the
    kernel's order: 3.3e-7 vs 8.7e-8). Each tile's products go into a zeroed tile first and the tiles
    are added here, which brought it back to 6.8e-8.
    """
    for i in range(rows):
        for j in range(cols):
            acc[i, j] += tile[i, j]
