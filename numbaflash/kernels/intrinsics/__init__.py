"""Device operations numba does not offer, written in pure Numba, each with a simulator emulation.

On a GPU these are `numba.cuda.extending.intrinsic`s that emit LLVM IR or inline PTX (`ptx`,
`ptx_hopper`). Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same names are plain Python
functions with the same semantics (`emulated`, `emulated_hopper`; collectives through `exchange`), so
every kernel that uses them runs in CI on the CPU. `target` says which mode this process is in.

* ``group_max(value, width)``, ``group_sum(value, width)``: reduce over each aligned group of ``width``
  lanes (a power of two dividing 32) and give every lane the result: a butterfly of shuffles on the
  GPU, one exchange under the simulator.
* ``warp_any(predicate)``: whether ``predicate`` holds in any lane of the warp, in every lane (``vote.any``).
* ``warp_uniform(value)``: a value every lane of the warp holds, as lane 0's (one shuffle), so that the
  compiler keeps what follows from it in uniform registers (CUTLASS's canonical warpgroup index).
* ``load2(arr, i)``, ``load4(arr, i)``: one vector load of n consecutive elements as a tuple: of a 1-D
  array from ``arr[i]``, or of an N-D one from ``arr[i]`` with ``i`` a tuple of indices (the last
  index runs). The caller guarantees alignment to the vector's size (at most 16 bytes). On shared
  memory this is one ``ld.shared.v4`` instead of n scalar loads, which keeps the register-tiled loops
  fed; on global memory it is one 16-byte load per thread. ``store2(arr, i, lo, hi)``: ``lo`` and ``hi`` into
  ``arr[i]`` and the element after it in one store, aligned to both (the emulation refuses a misaligned one, as
  the hardware faults). ``store2_row(arr, i, col, lo, hi)``: the same into ``arr[i + (col,)]`` and the element after
  it, ``i`` every index but the last, for an array whose last axis is contiguous (the emulation refuses another): the
  row's address once, ``col`` an element offset from it.
* ``float_bits(x)`` / ``bits_float(u)``: reinterpret float32 <-> uint32 (for bfloat16 conversion).

Tensor cores (compute capability >= 8.0; register fragments as in the PTX ISA, lane = 4 g + t):

* ``mma_f16(a0..a3, b0, b1, c0..c3)`` / ``mma_bf16``: ``mma.sync.m16n8k16.row.col.f32.{f16,bf16}``;
  A (16 x 16) in four uint32 (rows g and g + 8, column pairs 2t and 2t + 8), B (16 x 8) in two (column
  g, row pairs 2t and 2t + 8), C and D (16 x 8) in four float32 (rows g, g + 8; columns 2t, 2t + 1).
* ``ldmatrix_x4(smem, i)`` / ``ldmatrix_x4_trans``: four 8 x 8 b16 matrices from a 1-D uint16 shared
  array; lane ``l`` gives the row at element ``i`` of matrix ``l // 8``; ``.trans`` transposes each.
* ``cp_async_16(smem, i, src, (b, row, h, col), nbytes)``: copy 16 bytes from a 4-D global array to
  shared memory, without registers; ``nbytes = 0`` writes zeros. ``cp_async_commit()``,
  ``cp_async_wait_all()`` and ``cp_async_wait_one()`` (all but the newest group landed).
* ``pack_f16(lo, hi)`` / ``pack_bf16``: two float32 rounded to nearest into one f16x2 / bf16x2 word.
* ``ex2(x)``: ``ex2.approx.ftz.f32``, 2^x; ``rcp(x)``: ``rcp.approx.ftz.f32``, 1 / x (1 ulp);
  ``tanh_approx(x)``: ``tanh.approx.f32``, tanh x (one special-function instruction, relative error about
  2^-11; the emulation rounds the exact value); ``ex2_fma(x)``: 2^x from a cubic on the FMA pipe and the
  exponent bits (`polynomials`), relative error at most 2^-13.4 on [-126, 8], 0 at -127 and below, NaN for
  NaN: the softmax's exponentials without the special-function unit. ``ex2_fma_f16x2(lo, hi)``: 2^lo and 2^hi
  as one f16x2 word (lo in the low half), each exponent rounded to float16 first, then a cubic in HFMA2 steps:
  relative error at most 2^-10.7 on [-14, 8], float16's subnormals below, 0 at -22 and below, NaN for NaN.
* ``named_barrier_sync(barrier, threads)``, ``named_barrier_arrive(barrier, threads)``: ``bar.sync`` /
  ``bar.arrive`` on hardware barrier ``barrier`` (1 to 15; syncthreads has 0), which ``threads`` arrivals
  (a multiple of 32) complete; ``sync`` waits for that, ``arrive`` does not.

Hopper (compute capability 9.0, sm_90a; `ptx_hopper`):

* ``shared_address(smem, i)``: the shared-window byte address of ``smem[i]`` (uint32).
* ``wgmma_ss(n, storage)`` -> ``ss(acc, smem, desc_a, desc_b, accumulate)``: one warpgroup's
  ``wgmma.mma_async.m64n{n}k16.f32`` with A (64 x 16) and B (n x 16) in shared memory, both K-major,
  ``acc = A B^T (+ acc if accumulate)``; ``wgmma_ss(n, storage, mn_major=True)``: both MN-major, A
  stored as 16 rows of its 64 columns and B as 16 rows of n (``acc = A B``, A 64 x 16, B 16 x n); with
  ``fresh=True`` the product overwrites ``acc`` whatever ``accumulate`` says, and ``acc``'s old values are
  not its inputs (they need not stay in registers before it). ``rs(acc, a0, a1, a2, a3, smem, desc_b)`` from
  ``wgmma_rs(n, storage)``: ``acc += A B`` with A from registers (per warp, the m16n8k16 A fragment of
  its 16 rows) and B (16 x n) MN-major in shared memory; ``wgmma_rs(n, storage, first)`` takes its
  accumulators from flat element ``first`` of ``acc`` on. ``acc`` is a thread's (n / 8, 4) float32
  fragment array (rows ``16 w + g``, ``+ 8``; columns ``8 j + 2 t``, ``+ 1``, as mma.sync's C);
  descriptors are `wgmma.tiles.descriptor`s of the 128-byte swizzle. The emulation reads the operands
  from ``smem`` (the array the descriptors point into) and completes at once.
* ``wgmma_fence()``, ``wgmma_commit()``, ``wgmma_wait0()``, ``wgmma_wait1()`` (all but the newest
  group complete), and ``fence_proxy_async()``: shared memory written by the generic proxy (cp.async
  included) becomes visible to wgmma's reads.
* mbarriers in the 8 bytes at ``smem[i]`` (8-byte aligned): ``mbarrier_init(smem, i, count)`` (``count``
  arrivals complete a phase), ``mbarrier_arrive(smem, i)``, ``cp_async_mbarrier_arrive(smem, i)`` (one
  arrival once every earlier cp.async of the thread has landed: ``.noinc``), and
  ``mbarrier_try_wait(smem, i, parity)``: 1 once the phase of that parity has completed, else 0.
* ``mbarrier_arrive_expect_tx(smem, i, nbytes)``: an arrival that also expects ``nbytes`` from the copy
  engine before the phase completes; ``tma_load_4d(smem, dst, maps, which, c0, c1, c2, c3, barrier)``:
  the bulk tensor copy of one box of map ``which`` of a `wgmma.tensor_maps` set (the simulator's
  ``TENSOR_MAPS`` registry) into ``smem[dst ..]``, its bytes delivered to the mbarrier at ``smem[barrier]``,
  after ``tensormap_acquire(maps, which)`` once per thread and map (the host wrote the maps);
  ``bulk_load(smem, dst, src, i, nbytes, barrier)``: ``nbytes`` (a multiple of 16) of global array ``src``
  from element ``i`` (a tuple of indices, contiguous along the last) into ``smem[dst ..]`` by the same
  engine without a map (``cp.async.bulk``), both 16-byte aligned, its bytes delivered to that mbarrier.
* ``red_add2(arr, i, x, y)``: ``arr[i] += x`` and the element after it ``+= y`` (a float32 global array,
  ``i`` a tuple of indices whose last is even), atomically, as one ``red.global.add.v2.f32``.
* ``setmaxnreg_inc(count)()`` / ``setmaxnreg_dec(count)()``: the warpgroup's registers per thread
  raised or lowered to ``count`` (on the simulator, nothing).
"""

from .target import SIMULATOR, device_function

if SIMULATOR:
    from . import simulated_blocks
    from .emulated import *  # noqa: F401,F403
    from .emulated_hopper import *  # noqa: F401,F403

    simulated_blocks.install()
else:
    from .ptx import *  # noqa: F401,F403
    from .ptx_hopper import *  # noqa: F401,F403
