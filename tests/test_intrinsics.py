"""Each intrinsic against its definition: the simulator's emulation in CI, the hardware under -m gpu."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32, int32, uint16, uint64

from numbaflash.kernels.intrinsics import (SIMULATOR, bulk_load, cp_async_16, cp_async_commit, cp_async_mbarrier_arrive,
                                           cp_async_wait_all, device_function, ex2, ex2_fma, ex2_fma_f16x2, group_max,
                                           group_sum, ldmatrix_x4,
                                           ldmatrix_x4_trans, load4, mbarrier_arrive, mbarrier_arrive_expect_tx,
                                           mbarrier_init, mbarrier_try_wait,
                                           mma_bf16, mma_f16, named_barrier_arrive, named_barrier_sync,
                                           pack_bf16, pack_f16, rcp, setmaxnreg_dec, store2, store2_row,
                                           tanh_approx, warp_any, warp_uniform)

HALVES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def mma_kernel(mma):
    """One warp computes D = A B + C with ``mma``, each lane loading its own fragment registers."""

    @cuda.jit
    def kernel(a, b, c, d):
        # a: (16, 8) uint32 words of a 16 x 16 matrix; b: (8, 8) words, row n = column n of the 16 x 8 B.
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = mma(
            a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[g, t], b[g, t + 4],
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])

    return kernel


@pytest.mark.parametrize("dtype,mma", [("float16", mma_f16), ("bfloat16", mma_bf16)])
def test_mma_m16n8k16_is_a_times_b_plus_c(dtype, mma, arrays):
    to_device, to_host = arrays
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(HALVES[dtype])
    b = rng.standard_normal((16, 8)).astype(HALVES[dtype])
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    mma_kernel(mma)[1, 32](to_device(a.view(np.uint32)), to_device(np.ascontiguousarray(b.T).view(np.uint32)),
                           to_device(c), d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(to_host(d), want, rtol=1e-5, atol=1e-5)


@cuda.jit
def ldmatrix_kernel(src, out, trans):
    # A 16 x 16 tile, rows padded to 24 halves. Dynamic shared memory, as in the kernels: the simulator
    # allocates a static array on first use without a lock, and two threads could each get their own.
    smem = cuda.shared.array(0, uint16)
    lane = cuda.threadIdx.x
    for e in range(lane, 16 * 16, 32):
        smem[(e // 16) * 24 + e % 16] = src[e]
    cuda.syncthreads()
    # Lane l gives row (l % 8) of matrix l // 8; matrices: rows 0-7 | 8-15, then columns 0-7 | 8-15.
    row = lane % 8 + 8 * ((lane // 8) % 2)
    col = 8 * (lane // 16)
    if trans:
        r = ldmatrix_x4_trans(smem, row * 24 + col)
    else:
        r = ldmatrix_x4(smem, row * 24 + col)
    for j in range(4):
        out[lane, j] = r[j]


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4_gives_each_lane_its_fragment(trans, arrays):
    to_device, to_host = arrays
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16)
    out = to_device(np.zeros((32, 4), np.uint32))
    ldmatrix_kernel[1, 32, 0, 16 * 24 * 2](to_device(tile.ravel()), out, trans)
    got = to_host(out)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            m = tile[8 * (j % 2):8 * (j % 2) + 8, 8 * (j // 2):8 * (j // 2) + 8]  # matrix j
            m = m.T if trans else m
            lo, hi = m[g, 2 * t], m[g, 2 * t + 1]
            assert got[lane, j] == int(lo) | (int(hi) << 16), (lane, j)


@cuda.jit
def cp_async_kernel(src, out, rows):
    smem = cuda.shared.array(0, uint16)  # 4 x 16 halves, dynamic as in `ldmatrix_kernel`
    i = cuda.threadIdx.x  # 8 threads: 4 rows x 2 chunks of 8 halves
    row, chunk = i // 2, (i % 2) * 8
    ok = row < rows
    cp_async_16(smem, row * 16 + chunk, src, (0, row if ok else 0, 0, chunk), 16 if ok else 0)
    cp_async_commit()
    cp_async_wait_all()
    cuda.syncthreads()
    for x in range(8):
        out[row, chunk + x] = smem[row * 16 + chunk + x]


def test_cp_async_copies_16_bytes_and_zero_fills(arrays):
    to_device, to_host = arrays
    src = np.arange(1, 3 * 16 + 1, dtype=np.uint16).reshape(1, 3, 1, 16)
    out = to_device(np.full((4, 16), 7, np.uint16))
    cp_async_kernel[1, 8, 0, 4 * 16 * 2](to_device(src), out, 3)
    want = np.zeros((4, 16), np.uint16)
    want[:3] = src[0, :, 0]
    np.testing.assert_array_equal(to_host(out), want)


@cuda.jit
def pack_kernel(x, f16, bf16, e2, r, th):
    i = cuda.grid(1)
    if i < x.shape[0] // 2:
        f16[i] = pack_f16(x[2 * i], x[2 * i + 1])
        bf16[i] = pack_bf16(x[2 * i], x[2 * i + 1])
    if i < x.shape[0]:
        e2[i] = ex2(x[i])
        r[i] = rcp(x[i])
        th[i] = tanh_approx(x[i])


def test_pack_rounds_to_nearest_and_ex2_rcp_and_tanh_are_their_functions(arrays):
    to_device, to_host = arrays
    rng = np.random.default_rng(1)
    # Scores over many binades (tanh.approx's error is relative), both signs, and past tanh's saturation.
    x = (rng.standard_normal(256) * np.exp2(rng.integers(-12, 5, 256))).astype(np.float32)
    f16, bf16, e2, r, th = (to_device(np.zeros(n, dt)) for n, dt in ((128, np.uint32), (128, np.uint32),
                                                                     (256, np.float32), (256, np.float32),
                                                                     (256, np.float32)))
    pack_kernel[1, 256](to_device(x), f16, bf16, e2, r, th)
    np.testing.assert_array_equal(to_host(f16), x.astype(np.float16).view(np.uint32))
    np.testing.assert_array_equal(to_host(bf16), x.astype(ml_dtypes.bfloat16).view(np.uint32))
    finite = np.abs(x) < 100  # ex2 of the rest over- or underflows to inf or 0, as 2^x in float32
    np.testing.assert_allclose(to_host(e2)[finite], np.exp2(x.astype(np.float64))[finite], rtol=2e-7)  # 2 ulp
    np.testing.assert_allclose(to_host(r), 1 / x.astype(np.float64), rtol=1.2e-7)  # rcp.approx: 1 ulp
    np.testing.assert_allclose(to_host(th), np.tanh(x.astype(np.float64)), rtol=2.0 ** -10.9)  # tanh.approx


@cuda.jit
def ex2_fma_kernel(x, y):
    i = cuda.grid(1)
    if i < x.shape[0]:
        y[i] = ex2_fma(x[i])


def test_ex2_fma_is_2_to_the_x_within_its_bound_and_0_below_minus_127(arrays, mode):
    """The softmax's exponentials on the FMA pipe (`kernels.softmax.fma_chunk`): relative error at most 2^-13.4
    (`intrinsics.polynomials`) on [-126, 8], the softmax's exponents (up to 8 where a row keeps its maximum,
    `kernels.softmax.RESCALE_LOG2`); integers exact; -127 and below (a hidden score's -inf) exactly 0; NaN stays
    NaN. On a GPU the hardware also matches the emulation, step by step."""
    from numbaflash.kernels.intrinsics import emulated

    to_device, to_host = arrays
    rng = np.random.default_rng(2)
    integers = np.arange(-126, 9)
    x = np.concatenate([-rng.exponential(4.0, 2000), -rng.uniform(0, 1e-6, 48), integers, [-1e-30, 0.0],
                        rng.uniform(0, 8, 200), [-126.5, -127, -127.5, -300, -np.inf, np.nan]]).astype(np.float32)
    y = to_device(np.zeros_like(x))
    ex2_fma_kernel[(x.size + 127) // 128, 128](to_device(x), y)
    y = to_host(y)
    normal = x >= -126
    want = np.exp2(x[normal].astype(np.float64))
    error = np.abs(y[normal] / want - 1)
    assert error.max() <= 2.0 ** -13.4, f"max relative error {error.max():.3g}, mean {error.mean():.3g}"
    np.testing.assert_array_equal(y[2048:2048 + integers.size], np.exp2(integers).astype(np.float32))
    assert (y[-6:-1] == 0).all() and np.isnan(y[-1])
    if mode == "gpu":  # the emulation the simulator runs is the hardware's arithmetic (ties aside: 1 ulp)
        emulated_y = np.array([emulated.ex2_fma(v) for v in x], np.float32)
        np.testing.assert_array_max_ulp(y[~np.isnan(x)], emulated_y[~np.isnan(x)], maxulp=1)


@cuda.jit
def ex2_fma_f16x2_kernel(x, y):
    i = cuda.grid(1)
    if 2 * i + 1 < x.shape[0]:
        y[i] = ex2_fma_f16x2(x[2 * i], x[2 * i + 1])


def test_ex2_fma_f16x2_is_2_to_the_x_rounded_to_float16_within_its_bound(arrays, mode):
    """float16 P two at a time on the FMA pipe (`wgmma.tiles.pack_p`): the first argument's 2^x in the low half, the
    second's in the high; each x rounded to float16 first, then relative error at most 2^-10.7 on [-14, 8]
    (`intrinsics.polynomials`: the cubic and its float16 steps), float16's subnormals down to 2^-21.5 within 2^-24,
    integers exact, -22 and below (a hidden score's -inf) exactly 0, NaN stays NaN. On a GPU the hardware also
    matches the emulation bit for bit (NaN aside)."""
    from numbaflash.kernels.intrinsics import emulated

    to_device, to_host = arrays
    rng = np.random.default_rng(3)
    integers = np.arange(-14, 9)
    x = np.concatenate([-rng.exponential(4.0, 2000), rng.uniform(0, 8, 200), -rng.uniform(14, 21.4, 100), integers,
                        [-1e-30, 0.0, -22, -22.5, -23, -300, -1e30, -np.inf, np.nan]]).astype(np.float32)
    y = to_device(np.zeros(x.size // 2, np.uint32))
    ex2_fma_f16x2_kernel[(x.size // 2 + 127) // 128, 128](to_device(x), y)
    words = to_host(y)
    p = words.view(np.uint16).view(np.float16).astype(np.float64)  # little-endian: each word's low half first
    with np.errstate(over="ignore"):  # -1e30 rounds to float16's -inf: exactly 0
        exact = np.exp2(x.astype(np.float16).astype(np.float64))
    normal = (x >= -14) & (x <= 8)
    error = np.abs(p[normal] / exact[normal] - 1)
    assert error.max() <= 2.0 ** -10.7, f"max relative error {error.max():.3g}, mean {error.mean():.3g}"
    subnormal = (x < -14) & (x > -21.5)
    assert np.abs(p[subnormal] - exact[subnormal]).max() <= 2.0 ** -24
    at = x.size - 9 - integers.size
    np.testing.assert_array_equal(p[at:at + integers.size], np.exp2(integers))
    assert (p[-7:-1] == 0).all() and np.isnan(p[-1])
    if mode == "gpu":
        emulated_words = np.array([emulated.ex2_fma_f16x2(x[2 * i], x[2 * i + 1]) for i in range(x.size // 2)],
                                  np.uint32)
        emulated_p = emulated_words.view(np.uint16).view(np.float16)
        np.testing.assert_array_equal(words.view(np.uint16)[~np.isnan(p)], emulated_p.view(np.uint16)[~np.isnan(p)])
        assert np.isnan(emulated_p[np.isnan(p)]).all()  # NaN's bits are the hardware's own


@cuda.jit
def group_kernel(x, mx4, sum16, sum32, vec, votes):
    lane = cuda.threadIdx.x
    votes[lane] = 2 * warp_any(x[lane] > x[7]) + warp_any(x[lane] > x[7] + 1e30)
    mx4[lane] = group_max(x[lane], 4)
    sum16[lane] = group_sum(x[lane], 16)
    sum32[lane] = group_sum(x[lane], 32)
    v = load4(x, (lane // 4) * 4)
    vec[lane] = v[lane % 4]


def test_group_reductions_and_vector_loads(arrays):
    to_device, to_host = arrays
    x = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    outs = [to_device(np.zeros(32, np.float32)) for _ in range(5)]
    group_kernel[1, 32](to_device(x), *outs)
    mx4, sum16, sum32, vec, votes = (to_host(o) for o in outs)
    np.testing.assert_array_equal(votes, np.full(32, 2.0))  # some lane's x exceeds lane 7's; none by 1e30
    np.testing.assert_array_equal(mx4, np.repeat(x.reshape(8, 4).max(axis=1), 4))
    rounding = 1e-6 * np.abs(x).sum()  # float32 sums in butterfly order, against NumPy's pairwise order
    np.testing.assert_allclose(sum16, np.repeat(x.reshape(2, 16).sum(axis=1), 16), atol=rounding)
    np.testing.assert_allclose(sum32, np.full(32, x.sum()), atol=rounding)
    np.testing.assert_array_equal(vec, x)


@cuda.jit
def uniform_kernel(x, out):
    lane = cuda.threadIdx.x
    out[lane] = warp_uniform(x[lane])


def test_warp_uniform_gives_every_lane_lane_0s_value(arrays):
    to_device, to_host = arrays
    x = np.arange(10, 74, dtype=np.int32)  # two warps, each lane its own value
    out = to_device(np.zeros(64, np.int32))
    uniform_kernel[1, 64](to_device(x), out)
    np.testing.assert_array_equal(to_host(out), np.repeat([10, 42], 32))


@cuda.jit
def diverged_uniform_kernel(x, out):
    # lane 0 alone takes the shuffle, which waits for the warp's other lanes; they wait at the block's barrier
    lane = cuda.threadIdx.x
    if lane == 0:
        out[0] = warp_uniform(x[0])
    cuda.syncthreads()
    out[lane] += 1


@pytest.mark.skipif(not SIMULATOR, reason="a hang on the GPU; the simulator reports it")
def test_a_shuffle_by_part_of_a_warp_fails_the_simulated_block_instead_of_hanging():
    with pytest.raises(RuntimeError, match="can never go on: 31 of its 32 running threads wait at syncthreads"):
        diverged_uniform_kernel[1, 32](np.arange(32, dtype=np.int32), np.zeros(32, np.int32))


def register_cut_kernel(threads):
    release = setmaxnreg_dec(24)

    @cuda.jit
    def kernel(out):
        # the first ``threads`` of a warpgroup give their registers back; the rest wait at the block's barrier
        tid = cuda.threadIdx.x
        if tid < threads:
            release()
        cuda.syncthreads()
        out[tid] = 1

    return kernel


@pytest.mark.skipif(not SIMULATOR, reason="undefined on the GPU; the simulator reports it")
def test_setmaxnreg_by_part_of_a_warpgroup_fails_the_simulated_block():
    out = np.zeros(128, np.int32)
    register_cut_kernel(128)[1, 128](out)  # the whole warpgroup: goes on
    np.testing.assert_array_equal(out, np.ones(128, np.int32))
    with pytest.raises(RuntimeError, match="can never go on: 64 of its 128 running threads wait at syncthreads"):
        register_cut_kernel(64)[1, 128](np.zeros(128, np.int32))


@cuda.jit
def unfilled_stage_kernel(out, arrivals):
    # the mbarrier expects 64 arrivals, ``arrivals`` come, and every thread then waits for its phase
    smem = cuda.shared.array(0, uint16)
    tid = cuda.threadIdx.x
    if tid == 0:
        mbarrier_init(smem, 0, 64)
    cuda.syncthreads()
    if tid < arrivals:
        mbarrier_arrive(smem, 0)
    while mbarrier_try_wait(smem, 0, 0) == 0:
        pass
    out[tid] = 1


@pytest.mark.skipif(not SIMULATOR, reason="a hang on the GPU; the simulator reports it")
def test_an_mbarrier_wait_no_arrival_ends_fails_the_simulated_block_instead_of_hanging():
    out = np.zeros(64, np.int32)
    unfilled_stage_kernel[1, 64, 0, 8](out, 64)  # every arrival: the phase completes
    np.testing.assert_array_equal(out, np.ones(64, np.int32))
    with pytest.raises(RuntimeError, match="can never go on: 0 of its 64 running threads wait at syncthreads and 64"):
        unfilled_stage_kernel[1, 64, 0, 8](np.zeros(64, np.int32), 63)


@cuda.jit
def paired_store_kernel(out, shift):
    lane = cuda.threadIdx.x
    store2(out, (lane // 4, 2 * (lane % 4) + shift), np.uint16(lane), np.uint16(100 + lane))


def test_paired_stores_write_both_elements_and_refuse_misaligned_ones(arrays, mode):
    """store2: one store of two adjacent 16-bit elements (the tensor-core kernels' outputs); on the simulator a
    pair not aligned to 4 bytes is refused, as the hardware would fault."""
    to_device, to_host = arrays
    out = to_device(np.zeros((8, 10), np.uint16))
    paired_store_kernel[1, 32](out, 0)
    lane = np.arange(32)
    want = np.zeros((8, 10), np.uint16)
    want[lane // 4, 2 * (lane % 4)], want[lane // 4, 2 * (lane % 4) + 1] = lane, 100 + lane
    np.testing.assert_array_equal(to_host(out), want)
    if mode == "simulator":
        with pytest.raises(ValueError, match="not aligned to 4 bytes"):
            paired_store_kernel[1, 32](out, 1)


@cuda.jit
def row_store_kernel(out, shift):
    lane = cuda.threadIdx.x
    store2_row(out, (lane // 8, (lane // 4) % 2), 2 * (lane % 4) + shift, np.uint16(lane), np.uint16(100 + lane))


def test_row_stores_write_both_elements_at_the_row_offset(arrays, mode):
    """store2_row: store2 at a row's address plus a column offset (the wgmma kernels' outputs); on the simulator a
    misaligned pair and a row whose elements are not adjacent are refused, as the hardware would fault or write
    elsewhere."""
    to_device, to_host = arrays
    out = to_device(np.zeros((4, 2, 10), np.uint16))
    row_store_kernel[1, 32](out, 0)
    lane = np.arange(32)
    want = np.zeros((4, 2, 10), np.uint16)
    rows = (lane // 8, (lane // 4) % 2)
    want[rows + (2 * (lane % 4),)], want[rows + (2 * (lane % 4) + 1,)] = lane, 100 + lane
    np.testing.assert_array_equal(to_host(out), want)
    if mode == "simulator":
        with pytest.raises(ValueError, match="not aligned to 4 bytes"):
            row_store_kernel[1, 32](out, 1)
        with pytest.raises(ValueError, match="stride is 4 bytes, not 2"):
            store2_row(np.zeros((2, 8), np.uint16)[:, ::2], (0,), 0, np.uint16(1), np.uint16(2))


@device_function
def swizzled(r, c, rows):
    """Element offset of (r, c) in a tile of ``rows`` rows in wgmma's 128-byte swizzle: atoms of rows x 64
    elements, 16-byte chunk ``k`` of row ``r`` at chunk ``k ^ (r % 8)``."""
    return (c // 64) * rows * 64 + r * 64 + (((c % 64) // 8) ^ (r % 8)) * 8 + c % 8


def wgmma_kernel(N, K, storage):
    """One warpgroup: ``ss = A B^T`` (A 64 x K, B N x K, both K-major), ``rs = P V`` (P 64 x K from
    registers, V K x N MN-major) and ``mn = A^T V`` (A read as K x 64 and V, both MN-major; K = 64; the first
    k-step ``fresh``), each over K / 16 k-steps, from swizzled tiles the kernel stages itself."""
    from numbaflash.kernels.intrinsics import (fence_proxy_async, shared_address, wgmma_commit, wgmma_fence,
                                               wgmma_rs, wgmma_ss, wgmma_wait0)
    from numbaflash.kernels.fragments import fill
    from numbaflash.kernels.wgmma.tiles import aligned_base, descriptor

    ss, rs, mn = wgmma_ss(N, storage), wgmma_rs(N, storage), wgmma_ss(N, storage, mn_major=True)
    mn_first = wgmma_ss(N, storage, mn_major=True, fresh=True)
    B_AT, V_AT = 64 * K, 64 * K + N * K  # V's atoms are 64 columns wide, N or not
    NT = N // 8  # a compile-time constant, as the local arrays' shape must be

    @cuda.jit
    def kernel(a, b, v, p, out_ss, out_rs, out_mn):
        # a: (64, K), b: (N, K), v: (K, N) 16-bit words; p: (128, K / 16, 4) each thread's A words of P
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        base = aligned_base(smem)
        for e in range(tid, 64 * K, 128):
            smem[base + swizzled(e // K, e % K, 64)] = a[e // K, e % K]
        for e in range(tid, N * K, 128):
            smem[base + B_AT + swizzled(e // K, e % K, N)] = b[e // K, e % K]
            smem[base + V_AT + swizzled(e // N, e % N, K)] = v[e // N, e % N]
        fence_proxy_async()
        cuda.syncthreads()
        address = shared_address(smem, base)
        acc_ss = cuda.local.array((NT, 4), np.float32)
        acc_rs = cuda.local.array((NT, 4), np.float32)
        acc_mn = cuda.local.array((NT, 4), np.float32)
        fill(acc_ss, NT, 4, np.float32(7))  # the first k-step must overwrite these
        fill(acc_mn, NT, 4, np.float32(7))
        fill(acc_rs, NT, 4, np.float32(0))
        wgmma_fence()
        for kk in range(K // 16):
            step = (kk // 4) * 64 * 128 + (kk % 4) * 32
            ss(acc_ss, smem, descriptor(address + step, 0, 1024),
               descriptor(address + 2 * B_AT + (kk // 4) * N * 128 + (kk % 4) * 32, 0, 1024), kk)
        for ks in range(K // 16):
            rs(acc_rs, p[tid, ks, 0], p[tid, ks, 1], p[tid, ks, 2], p[tid, ks, 3], smem,
               descriptor(address + 2 * V_AT + ks * 16 * 128, K * 128, 1024))
            a_mn, v_mn = descriptor(address + ks * 16 * 128, K * 128, 1024), descriptor(
                address + 2 * V_AT + ks * 16 * 128, K * 128, 1024)
            if ks == 0:
                mn_first(acc_mn, smem, a_mn, v_mn, 1)  # overwrites, whatever its flag says
            else:
                mn(acc_mn, smem, a_mn, v_mn, 1)
        wgmma_commit()
        wgmma_wait0()
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for j in range(NT):
            for e in range(4):
                row, col = 16 * w + g + 8 * (e // 2), 8 * j + 2 * t + e % 2
                out_ss[row, col] = acc_ss[j, e]
                out_rs[row, col] = acc_rs[j, e]
                out_mn[row, col] = acc_mn[j, e]

    return kernel


def a_words(p):
    """(128, K / 16, 4): each warpgroup thread's m16n8k16 A words of its warp's 16 rows of p (64 x K)."""
    words = np.ascontiguousarray(p).view(np.uint32)  # word c of a row holds columns 2c, 2c + 1
    out = np.zeros((128, p.shape[1] // 16, 4), np.uint32)
    for tid in range(128):
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        r0, r1 = 16 * w + g, 16 * w + g + 8
        for ks in range(p.shape[1] // 16):
            c = 8 * ks + t
            out[tid, ks] = words[r0, c], words[r1, c], words[r0, c + 4], words[r1, c + 4]
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [16, 128])
def test_wgmma_products_from_swizzled_shared_memory(dtype, N, arrays):
    to_device, to_host = arrays
    if not SIMULATOR and cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")
    K = 64
    rng = np.random.default_rng(3)
    a, b, p = (rng.standard_normal(shape).astype(HALVES[dtype]) for shape in ((64, K), (N, K), (64, K)))
    v = rng.standard_normal((K, N)).astype(HALVES[dtype])
    out_ss, out_rs, out_mn = (to_device(np.zeros((64, N), np.float32)) for _ in range(3))
    smem_bytes = 2 * (64 * K + N * K + K * 64 * -(-N // 64)) + 1024
    wgmma_kernel(N, K, dtype)[1, 128, 0, smem_bytes](*(to_device(y.view(np.uint16)) for y in (a, b, v)),
                                                     to_device(a_words(p)), out_ss, out_rs, out_mn)
    wide = lambda y: y.astype(np.float64)
    np.testing.assert_allclose(to_host(out_ss), wide(a) @ wide(b).T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(to_host(out_rs), wide(p) @ wide(v), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(to_host(out_mn), wide(a).T @ wide(v), rtol=1e-5, atol=1e-4)


def row_sums_kernel(K, storage):
    """One warpgroup: `wgmma.row_sums` adds P 1 (P 64 x K from registers) into the accumulator block after O's 8
    columns (``first`` of `wgmma_rs`), over B's ones that its ``fill`` writes; O's block stays as it was."""
    from numbaflash.kernels.fragments import fill
    from numbaflash.kernels.intrinsics import fence_proxy_async, shared_address, wgmma_commit, wgmma_fence, wgmma_wait0
    from numbaflash.kernels.wgmma.row_sums import row_sums
    from numbaflash.kernels.wgmma.tiles import aligned_base

    fill_ones, descriptor, add = row_sums(8, K, storage)

    @cuda.jit
    def kernel(p, out_o, out_sums):
        # p: (128, K / 16, 4) each thread's A words of P; out_o, out_sums: (64, 8)
        smem = cuda.shared.array(0, uint16)
        words = cuda.shared.array(0, uint64)
        tid = cuda.threadIdx.x
        base = aligned_base(smem)
        fill_ones(words, base, tid, 128)
        fence_proxy_async()
        cuda.syncthreads()
        acc = cuda.local.array((2, 4), np.float32)
        fill(acc, 1, 4, np.float32(7))  # O's block: no product of the sums may touch it
        for e in range(4):
            acc[1, e] = np.float32(0.5)  # the sums add onto what the accumulators hold
        wgmma_fence()
        add(acc, p[tid], smem, descriptor(shared_address(smem, base), 0))
        wgmma_commit()
        wgmma_wait0()
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for j in range(2):
            for e in range(4):
                row, col = 16 * w + g + 8 * (e // 2), 2 * t + e % 2
                (out_o if j == 0 else out_sums)[row, col] = acc[j, e]

    return kernel


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_row_sums_add_p_times_ones_after_o(dtype, arrays):
    to_device, to_host = arrays
    if not SIMULATOR and cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")
    K = 32
    p = np.random.default_rng(5).uniform(0, 4, (64, K)).astype(HALVES[dtype])
    out_o, out_sums = (to_device(np.zeros((64, 8), np.float32)) for _ in range(2))
    row_sums_kernel(K, dtype)[1, 128, 0, 2048 + 1024](to_device(a_words(p)), out_o, out_sums)
    want = p.astype(np.float64).sum(axis=1, keepdims=True) + 0.5
    np.testing.assert_allclose(to_host(out_sums), np.broadcast_to(want, (64, 8)), rtol=1e-6)
    np.testing.assert_array_equal(to_host(out_o), np.full((64, 8), 7, np.float32))


@cuda.jit
def mbarrier_kernel(src, out, flags, use_cp_async):
    # Warp 1 copies src into shared memory and arrives; warp 0 waits for the phase, then reads.
    smem = cuda.shared.array(0, uint16)  # 64 halves of data, then the 8-byte barrier at element 64
    tid = cuda.threadIdx.x
    if tid == 0:
        mbarrier_init(smem, 64, 32)
    cuda.syncthreads()
    if tid >= 32:
        lane = tid - 32
        if use_cp_async:
            if lane < 8:
                cp_async_16(smem, 8 * lane, src, (0, 0, 0, 8 * lane), 16)
            cp_async_mbarrier_arrive(smem, 64)
        else:
            smem[2 * lane], smem[2 * lane + 1] = src[0, 0, 0, 2 * lane], src[0, 0, 0, 2 * lane + 1]
            mbarrier_arrive(smem, 64)
    else:
        while mbarrier_try_wait(smem, 64, 0) == 0:
            pass
        flags[tid] = mbarrier_try_wait(smem, 64, 1)  # phase 1 has had no arrival: not complete
        out[2 * tid], out[2 * tid + 1] = smem[2 * tid], smem[2 * tid + 1]


@pytest.mark.parametrize("use_cp_async", [False, True])
def test_mbarrier_phase_completes_after_count_arrivals(use_cp_async, arrays):
    to_device, to_host = arrays
    if not SIMULATOR and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("these mbarrier forms need compute capability 9.0")
    src = np.arange(1, 65, dtype=np.uint16).reshape(1, 1, 1, 64)
    out, flags = to_device(np.zeros(64, np.uint16)), to_device(np.full(32, 7, np.uint32))
    mbarrier_kernel[1, 64, 0, 64 * 2 + 8](to_device(src), out, flags, use_cp_async)
    np.testing.assert_array_equal(to_host(out), src.ravel())
    np.testing.assert_array_equal(to_host(flags), np.zeros(32, np.uint32))


@cuda.jit
def bulk_load_kernel(src, out, row, count):
    # Thread 0 announces and issues two bulk copies of ``count`` float32 each (rows 1 and 0 of src[1, 2] from
    # element ``row``) onto one mbarrier; every thread waits for its phase, then copies shared memory out.
    smem = cuda.shared.array(0, uint16)
    words = cuda.shared.array(0, float32)
    tid = cuda.threadIdx.x
    barrier = 4 * count  # after the 2 count floats (4 count 16-bit elements), 8-byte aligned
    if tid == 0:
        mbarrier_init(smem, barrier, 1)
    cuda.syncthreads()
    if tid == 0:
        mbarrier_arrive_expect_tx(smem, barrier, 8 * count)
        bulk_load(smem, 0, src, (1, 2, 1, row), 4 * count, barrier)
        bulk_load(smem, 2 * count, src, (1, 2, 0, row), 4 * count, barrier)
    while mbarrier_try_wait(smem, barrier, 0) == 0:
        pass
    for i in range(tid, 2 * count, cuda.blockDim.x):
        out[i] = words[i]


def test_bulk_load_copies_rows_onto_an_mbarrier(arrays):
    to_device, to_host = arrays
    if not SIMULATOR and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("cp.async.bulk needs compute capability 9.0")
    src = np.random.default_rng(5).standard_normal((2, 3, 2, 96)).astype(np.float32)
    count, row = 32, 20  # 128 bytes from a 16-byte-aligned element
    out = to_device(np.zeros(2 * count, np.float32))
    bulk_load_kernel[1, 64, 0, 8 * count + 16](to_device(src), out, row, count)
    np.testing.assert_array_equal(to_host(out), np.concatenate([src[1, 2, 1, row:row + count], src[1, 2, 0, row:row + count]]))


@cuda.jit
def turns_kernel(log, rounds):
    # Warps 0 and 1 take turns as the ping-pong consumers do: each waits on its own barrier (1 + warp),
    # takes its turn and arrives on the other's; warp 1's first arrival lets warp 0 go first, and it skips
    # its last, which no turn would wait for.
    turn = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    warp = tid // 32
    if tid == 0:
        turn[0] = 0
    cuda.syncthreads()
    if warp == 1:
        named_barrier_arrive(1, 64)
    for r in range(rounds):
        named_barrier_sync(1 + warp, 64)
        if tid % 32 == 0:
            log[turn[0]] = warp
            turn[0] += 1
        if warp == 0 or r < rounds - 1:
            named_barrier_arrive(2 - warp, 64)


def test_named_barriers_alternate_two_warps(arrays):
    to_device, to_host = arrays
    log = to_device(np.full(12, -1, np.int32))
    turns_kernel[1, 64](log, 6)
    np.testing.assert_array_equal(to_host(log), np.arange(12) % 2)
