"""The producer kernels (v5) read a stage only between the wait that lands it and their release of it.

On the simulator every thread runs free, so a consumer that reads a stage before its wait usually finds the
producer already done with it, and one that reads it after releasing it usually finds it not yet refilled: v5's
dK/dV consumers read the staged ALiBi slope before their wait and passed every simulated test, and racecheck found it
on the H200. Under `simulated_blocks.producer_last` the producer warpgroup holds after each wait until the consumers
wait too, so a read before the wait finds the stage's last fill; under `consumers_last` the consumers hold, so the
producer refills each stage as soon as it is released, and a read after the release finds the next fill. These tests
run the v5 forward, backward and packed (varlen) kernels all three ways and ask for the same bits.
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import tiling
from numbaflash.kernels.intrinsics import SIMULATOR
from numbaflash.tiling import WgmmaTiles

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="producer_last and consumers_last hold the simulator's threads")

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


def assert_same_bits_every_way(call, names):
    """``call()``'s arrays the same, bit for bit, free-running, with the producer last and with the consumers last."""
    free = call()
    for order in (simulated_blocks.producer_last, simulated_blocks.consumers_last):
        with order():
            held = call()
        for name, a, b in zip(names, free, held):
            a, b = np.asarray(a), np.asarray(b)
            assert np.array_equal(a, b, equal_nan=True), (
                f"{name} differs under {order.__name__}: max {np.nanmax(np.abs(a.astype(np.float64) - b)):.3g}, "
                f"mean {np.nanmean(np.abs(a.astype(np.float64) - b)):.3g}")


if SIMULATOR:
    @cuda.jit(device=True)
    def fresh(bars, value):
        """Thread 0 sets ``value[0]`` to 0 and makes each of ``bars`` an mbarrier of one arrival; the block syncs.
        Returns the thread's index."""
        t = cuda.threadIdx.x
        if t == 0:
            value[0] = 0
            for i in range(bars.shape[0]):
                mbarrier_init(bars, i, 1)
        cuda.syncthreads()
        return t


def test_producer_last_holds_the_producer_until_the_consumers_wait():
    """A consumer's read before its wait sees the shared value from before the producer's store, its read after the
    wait the store: the producer passed its own wait at once, and held there."""

    @cuda.jit
    def kernel(out):
        bars, value = cuda.shared.array(2, np.uint64), cuda.shared.array(1, np.int32)
        t = fresh(bars, value)
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


def test_consumers_last_holds_the_consumers_until_the_producer_waits():
    """A consumer that signals the producer and passes a wait of its own reads the producer's store, made once the
    signal arrived and before the producer waits again: free-running it reads first."""

    @cuda.jit
    def kernel(out):
        bars, value = cuda.shared.array(3, np.uint64), cuda.shared.array(1, np.int32)
        t = fresh(bars, value)
        if t == 0:  # the producer
            while mbarrier_try_wait(bars, 2, 0) == 0:  # the consumer's signal
                pass
            value[0] = 1
            while mbarrier_try_wait(bars, 0, 0) == 0:  # the consumer's release
                pass
        elif t == 128:  # a consumer
            mbarrier_arrive(bars, 2)
            while mbarrier_try_wait(bars, 1, 1) == 0:  # a fresh barrier's last phase: passes at once
                pass
            out[0] = value[0]
            mbarrier_arrive(bars, 0)

    for _ in range(3):
        out = np.full(1, -1, np.int32)
        with simulated_blocks.consumers_last():
            kernel[1, 256](out)
        assert out[0] == 1


def test_the_v5_backward_reads_its_stages_between_their_waits_and_releases():
    """dK/dV and dQ passes: Q, dO, LSE, D and the ALiBi slope staged per query tile of each GQA head, K and V per
    key tile."""
    q, dout = operands(1, (B, SEQLEN_Q, NHEADS, HEADDIM), (B, SEQLEN_Q, NHEADS, HEADDIM))
    k, v = operands(2, (B, SEQLEN_K, NHEADS_KV, HEADDIM), (B, SEQLEN_K, NHEADS_KV, HEADDIM))
    out, lse = numbaflash.attention(q, k, v, alibi_slopes=SLOPES, return_lse=True)
    plan = tiling.make_plan(B, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, HEADDIM, "float16", backward=True,
                            tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES)
    assert_same_bits_every_way(lambda: numbaflash.attention_backward(dout, q, k, v, out, lse, alibi_slopes=SLOPES,
                                                                     plan=plan), ("dq", "dk", "dv"))


def test_the_v5_forward_reads_its_stages_between_their_waits_and_releases():
    """Two consumers taking turns over K and V tiles, causal with ALiBi over GQA."""
    q, = operands(3, (B, SEQLEN_Q, NHEADS, HEADDIM))
    k, v = operands(4, (B, SEQLEN_K, NHEADS_KV, HEADDIM), (B, SEQLEN_K, NHEADS_KV, HEADDIM))
    plan = tiling.make_plan(B, NHEADS, NHEADS_KV, SEQLEN_Q, SEQLEN_K, HEADDIM, "float16", tiles=FORWARD_TILES)
    assert_same_bits_every_way(lambda: numbaflash.attention(q, k, v, causal=True, alibi_slopes=SLOPES,
                                                            return_lse=True, plan=plan), ("out", "lse"))


def test_packed_sequences_read_their_zeroed_tails_between_their_waits_and_releases():
    """varlen, forward and backward: the producer's warp zeroes the rows past a sequence in its last tiles before
    the consumers take them (`pipeline.tail_zeroer`)."""
    seqlens_q, seqlens_k = [5, 23, 12], [30, 9, 21]
    nheads, slopes = 2, SLOPES[:2]  # two heads of one kv head: the simulated calls take half as long as four
    q, dout = operands(5, (sum(seqlens_q), nheads, HEADDIM), (sum(seqlens_q), nheads, HEADDIM))
    k, v = operands(6, (sum(seqlens_k), NHEADS_KV, HEADDIM), (sum(seqlens_k), NHEADS_KV, HEADDIM))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (seqlens_q, seqlens_k))
    shape = (len(seqlens_q), nheads, NHEADS_KV, max(seqlens_q), max(seqlens_k), HEADDIM, "float16")
    forward = tiling.make_plan(*shape, tiles=FORWARD_TILES, packed=True)
    backward = tiling.make_plan(*shape, backward=True, tiles=tiling.SIMULATOR_WGMMA_BACKWARD_TILES, packed=True)
    lengths = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))

    def call():
        out, lse = numbaflash.attention_varlen(q, k, v, *lengths, alibi_slopes=slopes, return_lse=True, plan=forward)
        return (out, lse, *numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, *lengths, alibi_slopes=slopes,
                                                                plan=backward))

    assert_same_bits_every_way(call, ("out", "lse", "dq", "dk", "dv"))
