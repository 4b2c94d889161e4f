"""The producer kernels (v5) read what their producer stages only after the wait that lands it.

On the simulator every thread runs free, so a consumer that reads a stage before its wait usually finds the
producer already done with it: v5's dK/dV consumers read the staged ALiBi slope that way and passed every simulated
test, and racecheck found it on the H200. Under `simulated_blocks.producer_last` the producer warpgroup holds after
each wait until the consumers wait too, so such a read finds the stage's last fill; these tests run the v5 forward,
backward and packed (varlen) kernels both ways and ask for the same bits.
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import tiling
from numbaflash.kernels.intrinsics import SIMULATOR
from numbaflash.tiling import WgmmaTiles

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="producer_last holds the simulator's threads")

if SIMULATOR:
    from numba import cuda

    from numbaflash.kernels.intrinsics import (mbarrier_arrive, mbarrier_init, mbarrier_try_wait,
                                               simulated_blocks)

# GQA with a slope per query head: a tile that took another head's slope gives other gradients.
B, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEADDIM = 1, 40, 70, 4, 1, 40
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
FORWARD_TILES = WgmmaTiles(128, 16, 2, producer=True, tma=True, pingpong=True)


def operands(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float16) for shape in shapes]


def both_ways(call):
    """``call()``'s arrays, free-running and with the producer last."""
    free = call()
    with simulated_blocks.producer_last():
        last = call()
    return free, last


def assert_same_bits(free, last, names):
    for name, a, b in zip(names, free, last):
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(a, b, equal_nan=True), (
            f"{name} differs with the producer last: max {np.nanmax(np.abs(a.astype(np.float64) - b)):.3g}, "
            f"mean {np.nanmean(np.abs(a.astype(np.float64) - b)):.3g}")


def test_producer_last_holds_the_producer_until_the_consumers_wait():
    """A consumer's read before its wait sees the shared value from before the producer's store, its read after the
    wait the store: the producer passed its own wait at once, and held there."""

    @cuda.jit
    def kernel(out):
        bars = cuda.shared.array(2, np.uint64)
        value = cuda.shared.array(1, np.int32)
        t = cuda.threadIdx.x
        if t == 0:
            value[0] = 0
            mbarrier_init(bars, 0, 1)
            mbarrier_init(bars, 1, 1)
        cuda.syncthreads()
        if t == 0:  # the producer: its wait on a fresh barrier's last phase passes at once
            while mbarrier_try_wait(bars, 1, 1) == 0:
                pass
            value[0] = 1
            mbarrier_arrive(bars, 0)
        elif t == 128:  # a consumer
            before = value[0]
            while mbarrier_try_wait(bars, 0, 0) == 0:
                pass
            out[0], out[1] = before, value[0]

    for _ in range(3):
        out = np.full(2, -1, np.int32)
        with simulated_blocks.producer_last():
            kernel[1, 256](out)
        assert list(out) == [0, 1]


def test_the_v5_backward_reads_its_staged_tiles_and_slopes_after_their_waits():
    """dK/dV and dQ passes: Q, dO, LSE, D and the ALiBi slope staged per query tile of each GQA head, K and V per
    key tile."""
    q, dout = operands(1, (B, SEQLEN_Q, NHEADS, HEADDIM), (B, SEQLEN_Q, NHEADS, HEADDIM))
    k, v = operands(2, (B, SEQLEN_K, NHEADS_KV, HEADDIM), (B, SEQLEN_K, NHEADS_KV, HEADDIM))
    out, lse = numbaflash.attention(q, k, v, alibi_slopes=SLOPES, return_lse=True)
    plan = tiling.make_plan(B, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, HEADDIM, "float16", backward=True,
                            tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
    free, last = both_ways(lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, alibi_slopes=SLOPES,
                                                                 plan=plan))
    assert_same_bits(free, last, ("dq", "dk", "dv"))


def test_the_v5_forward_reads_its_staged_tiles_after_their_waits():
    """Two consumers taking turns over K and V tiles, causal with ALiBi over GQA."""
    q, = operands(3, (B, SEQLEN_Q, NHEADS, HEADDIM))
    k, v = operands(4, (B, SEQLEN_K, NHEADS_KV, HEADDIM), (B, SEQLEN_K, NHEADS_KV, HEADDIM))
    plan = tiling.make_plan(B, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, HEADDIM, "float16", tiles=FORWARD_TILES)
    free, last = both_ways(lambda: numbaflash.attention(q, k, v, causal=True, alibi_slopes=SLOPES, return_lse=True,
                                                        plan=plan))
    assert_same_bits(free, last, ("out", "lse"))


def test_packed_sequences_read_their_zeroed_tails_after_their_waits():
    """varlen, forward and backward: the producer's warp zeroes the rows past a sequence in its last tiles before
    the consumers take them (`pipeline.tail_zeroer`)."""
    seqlens_q, seqlens_k = [5, 23, 12], [30, 9, 21]
    q, dout = operands(5, (sum(seqlens_q), NHEADS, HEADDIM), (sum(seqlens_q), NHEADS, HEADDIM))
    k, v = operands(6, (sum(seqlens_k), NHEADS_KV, HEADDIM), (sum(seqlens_k), NHEADS_KV, HEADDIM))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (seqlens_q, seqlens_k))
    shape = (len(seqlens_q), NHEADS, NHEADS_KV, max(seqlens_q), max(seqlens_k), HEADDIM, "float16")
    forward = tiling.make_plan(*shape, tiles=FORWARD_TILES, packed=True)
    backward = tiling.make_plan(*shape, backward=True, tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES, packed=True)
    lengths = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))

    def call():
        out, lse = numbaflash.attention_varlen(q, k, v, *lengths, alibi_slopes=SLOPES, return_lse=True, plan=forward)
        return (out, lse, *numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, *lengths, alibi_slopes=SLOPES,
                                                                plan=backward))

    free, last = both_ways(call)
    assert_same_bits(free, last, ("out", "lse", "dq", "dk", "dv"))
