"""Device operations numba does not offer, written in pure Numba, each with a simulator emulation.

On a GPU these are `numba.cuda.extending.intrinsic`s that emit LLVM IR or inline PTX. Under the CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) the same names are plain Python functions with the same
semantics, so every kernel that uses them runs in CI on the CPU. Warp-collective operations (shuffles)
emulate the warp with a per-warp exchange: each lane deposits its operand, the 32 lanes meet at a
barrier, and each lane reads what the hardware would have routed to it.

* ``group_max(value, width)``, ``group_sum(value, width)``: reduce over each aligned group of ``width``
  lanes (a power of two dividing 32) and give every lane the result: a butterfly of shuffles on the
  GPU, one exchange under the simulator.
* ``load2(arr, i)``, ``load4(arr, i)``: one vector load of n consecutive elements as a tuple: of a 1-D
  array from ``arr[i]``, or of an N-D one from ``arr[i]`` with ``i`` a tuple of indices (the last
  index runs). The caller guarantees alignment to the vector's size (at most 16 bytes). On shared
  memory this is one ``ld.shared.v4`` instead of n scalar loads, which keeps the register-tiled loops
  fed; on global memory it is one 16-byte load per thread.
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
* ``ex2(x)``: ``ex2.approx.ftz.f32``, 2^x.

``device_function(fn)`` makes a plain Python function callable from kernels and from other device
functions: registered with numba as a CUDA overload of itself on a GPU, left as is under the simulator
(where kernels are Python too). Either way it returns ``fn``, which stays callable from Python. NVVM
inlines these functions, and a register array a kernel passes in is then indexed by constants and
stays in registers (ptxas reports no local memory). Inlining them at the Numba IR level instead
re-typed every copy: 25-45 s to compile one kernel instead of 3.
"""

import threading

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_function(fn):
    if not SIMULATOR:
        from numba.cuda.extending import register_jitable

        register_jitable(inline="never")(fn)
    return fn


if SIMULATOR:
    _registry_lock = threading.Lock()

    class _Warp:
        """Two slot buffers used alternately: one barrier per exchange suffices, because a lane can only
        write buffer n + 2 after barrier n + 1, which every lane passes only after reading buffer n."""

        def __init__(self, size):
            self.barrier = threading.Barrier(size)
            self.buffers = ([None] * size, [None] * size)
            self.generation = [0] * size
            self.lock = threading.Lock()
            self.results = [None, None]  # (generation, value) of the last warp-wide result per buffer

    def _deposit(value):
        """Deposit ``value`` in the calling thread's warp and wait for all its lanes: every lane's values,
        this lane, its warp and the exchange's generation."""
        thread = threading.current_thread()
        lane = thread.thread_id % 32
        warp = getattr(thread, "_numbaflash_warp", None)
        if warp is None:  # first exchange of this simulated thread: find or make its warp
            manager = thread._manager  # the simulator's BlockManager: one per running thread block
            warp_id = thread.thread_id // 32
            with _registry_lock:
                warps = manager.__dict__.setdefault("_numbaflash_warps", {})
                if warp_id not in warps:
                    block_threads = int(np.prod(manager._block_dim))
                    warps[warp_id] = _Warp(min(32, block_threads - 32 * warp_id))
                warp = thread._numbaflash_warp = warps[warp_id]
        generation = warp.generation[lane]
        slots = warp.buffers[generation % 2]
        warp.generation[lane] += 1
        slots[lane] = value
        warp.barrier.wait()
        return slots, lane, warp, generation

    def _exchange(value):
        """All lanes of the calling thread's warp deposit ``value``; each gets every lane's value."""
        slots, lane, _, _ = _deposit(value)
        return slots, lane

    def _warp_result(value, compute):
        """Exchange ``value``; ``compute(values of all lanes)`` runs once per warp and every lane gets its
        result (a lane reads it before it can reach the exchange after next, which would reuse the slot)."""
        slots, lane, warp, generation = _deposit(value)
        with warp.lock:
            done = warp.results[generation % 2]
            if done is None or done[0] != generation:
                done = warp.results[generation % 2] = (generation, compute(slots))
        return done[1], lane

    def _group(value, width):
        lanes, lane = _exchange(value)
        start = lane - lane % width
        return lanes[start:start + width]

    def group_max(value, width):
        return max(_group(value, width))

    def group_sum(value, width):
        # The butterfly's order of additions, so the simulator rounds exactly as the GPU does.
        values = _group(value, width)
        lane = threading.current_thread().thread_id % width
        offset = width // 2
        while offset > 0:
            values = [values[i] + values[i ^ offset] for i in range(width)]
            offset //= 2
        return values[lane]

    def _vector(arr, i, n):
        if isinstance(i, tuple):
            return tuple(arr[i[:-1] + (i[-1] + x,)] for x in range(n))
        return tuple(arr[i + x] for x in range(n))

    def load2(arr, i):
        return _vector(arr, i, 2)

    def load4(arr, i):
        return _vector(arr, i, 4)

    def float_bits(x):
        return np.array(x, dtype=np.float32).view(np.uint32)[()]

    def bits_float(u):
        return np.array(u, dtype=np.uint32).view(np.float32)[()]

    import ml_dtypes

    # Where lane l's register r, half h sits in A (16 x 16) and B (16 x 8), and register r in C/D (16 x 8).
    _l, _r, _h = np.ogrid[:32, :4, :2]
    A_AT = ((_l >> 2) + 8 * (_r & 1), 2 * (_l & 3) + _h + 8 * (_r >> 1))
    _l, _r, _h = np.ogrid[:32, :2, :2]
    B_AT = (2 * (_l & 3) + _h + 8 * _r, np.broadcast_to(_l >> 2, (32, 2, 2)))
    _l, _r = np.ogrid[:32, :4]
    C_AT = ((_l >> 2) + 8 * (_r >> 1), 2 * (_l & 3) + (_r & 1))

    def _matrix(words, dtype, shape, at):
        """A warp's fragment registers (uint32 of two 16-bit values, low half first) as one matrix."""
        m = np.zeros(shape, dtype=np.float64)
        regs = np.array(words, dtype=np.uint32)
        m[at] = regs.view(dtype).reshape(regs.shape + (2,))
        return m

    def _mma(dtype, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def product(lanes):
            a = _matrix([x[0] for x in lanes], dtype, (16, 16), A_AT)
            b = _matrix([x[1] for x in lanes], dtype, (16, 8), B_AT)
            c = np.zeros((16, 8), dtype=np.float64)
            c[C_AT] = np.array([x[2] for x in lanes], dtype=np.float32)
            # Products of 16-bit values are exact in float32; the sum is rounded once, to float32.
            return (a @ b + c).astype(np.float32)

        d, lane = _warp_result(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), product)
        g, t = lane >> 2, lane & 3
        return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

    def mma_f16(*regs):
        return _mma(np.float16, *regs)

    def mma_bf16(*regs):
        return _mma(ml_dtypes.bfloat16, *regs)

    def _word(lo, hi):
        return np.uint32(int(lo) | (int(hi) << 16))

    def ldmatrix_x4(smem, i):
        rows, lane = _exchange(int(i))
        g, t = lane >> 2, lane & 3
        return tuple(_word(smem[rows[8 * j + g] + 2 * t], smem[rows[8 * j + g] + 2 * t + 1]) for j in range(4))

    def ldmatrix_x4_trans(smem, i):
        rows, lane = _exchange(int(i))
        g, t = lane >> 2, lane & 3
        return tuple(_word(smem[rows[8 * j + 2 * t] + g], smem[rows[8 * j + 2 * t + 1] + g]) for j in range(4))

    def cp_async_16(smem, i, src, index, nbytes):
        # The copy completes at once: a legal schedule of an asynchronous copy (it may land any time
        # before the wait), so the kernels' barriers and waits are what make it correct either way.
        b, row, h, col = index
        for x in range(8):
            smem[i + x] = src[b, row, h, col + x] if nbytes else 0

    def cp_async_commit():
        pass

    def cp_async_wait_all():
        pass

    def cp_async_wait_one():
        pass

    def _pack(lo, hi, dtype):
        return np.array([lo, hi], dtype=np.float32).astype(dtype).view(np.uint32)[0]

    def pack_f16(lo, hi):
        return _pack(lo, hi, np.float16)

    def pack_bf16(lo, hi):
        return _pack(lo, hi, ml_dtypes.bfloat16)

    def ex2(x):
        return np.float32(np.exp2(np.float32(x)))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @device_function
    def group_max(value, width):
        offset = width // 2
        while offset > 0:
            value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, offset))
            offset //= 2
        return value

    @device_function
    def group_sum(value, width):
        offset = width // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
            offset //= 2
        return value

    def _element_pointer(context, builder, aryty, ary_value, index_value, index_type):
        ary = context.make_array(aryty)(context, builder, ary_value)
        if isinstance(index_type, types.BaseTuple):
            indices = [context.cast(builder, builder.extract_value(index_value, d), index_type[d], types.intp)
                       for d in range(len(index_type))]
        else:
            indices = [context.cast(builder, index_value, index_type, types.intp)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, indices, wraparound=False)

    def _indexes(arr, i):
        if isinstance(i, types.BaseTuple):
            return len(i) == arr.ndim and all(isinstance(t, types.Integer) for t in i)
        return arr.ndim == 1 and isinstance(i, types.Integer)

    def _vector_load(n):
        def load(typingctx, arr, i):
            if not isinstance(arr, types.Array) or not _indexes(arr, i):
                return None
            sig = types.UniTuple(arr.dtype, n)(arr, i)

            def codegen(context, builder, sig, args):
                ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                element = context.get_data_type(sig.args[0].dtype)
                vec_type = ir.VectorType(element, n)
                size = n * context.get_abi_sizeof(element)
                vec = builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=min(size, 16))
                values = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(n)]
                return context.make_tuple(builder, sig.return_type, values)

            return sig, codegen

        load.__name__ = f"load{n}"
        return intrinsic(load)

    load2 = _vector_load(2)
    load4 = _vector_load(4)

    def _asm(builder, signature_types, ret, template, constraints, args, side_effect):
        fnty = ir.FunctionType(ret, signature_types)
        return builder.call(ir.InlineAsm(fnty, template, constraints, side_effect=side_effect), args)

    def _mma(kind):
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u, f = types.uint32, types.float32
            sig = types.UniTuple(f, 4)(u, u, u, u, u, u, f, f, f, f)

            def codegen(context, builder, signature, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                args = [context.cast(builder, v, t, want) for v, t, want in zip(args, signature.args, sig.args)]
                res = _asm(builder, [i32] * 6 + [f32] * 4, ir.LiteralStructType([f32] * 4),
                           f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                           "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args, False)
                return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, i) for i in range(4)])

            return sig, codegen

        return mma

    mma_f16 = _mma("f16")
    mma_bf16 = _mma("bf16")

    def _shared_address(context, builder, aryty, ary_value, index_value, index_type):
        """A 32-bit shared-space address of an element (ldmatrix and cp.async take .shared addresses)."""
        ptr = _element_pointer(context, builder, aryty, ary_value, index_value, index_type)
        shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
        return builder.ptrtoint(shared, ir.IntType(32))

    def _ldmatrix(trans):
        @intrinsic
        def ldmatrix(typingctx, smem, i):
            if not isinstance(smem, types.Array) or smem.ndim != 1:
                return None
            sig = types.UniTuple(types.uint32, 4)(smem, i)

            def codegen(context, builder, signature, args):
                i32 = ir.IntType(32)
                address = _shared_address(context, builder, signature.args[0], args[0], args[1], signature.args[1])
                res = _asm(builder, [i32], ir.LiteralStructType([i32] * 4),
                           f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
                           "=r,=r,=r,=r,r,~{memory}", [address], True)
                return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, k) for k in range(4)])

            return sig, codegen

        return ldmatrix

    ldmatrix_x4 = _ldmatrix(False)
    ldmatrix_x4_trans = _ldmatrix(True)

    @intrinsic
    def cp_async_16(typingctx, smem, i, src, index, nbytes):
        if not (isinstance(smem, types.Array) and isinstance(src, types.Array) and _indexes(src, index)):
            return None
        sig = types.void(smem, i, src, index, nbytes)

        def codegen(context, builder, signature, args):
            st, it, gt, xt, nt = signature.args
            dst = _shared_address(context, builder, st, args[0], args[1], it)
            ptr = _element_pointer(context, builder, gt, args[2], args[3], xt)
            glob = builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1)), ir.IntType(64))
            size = context.cast(builder, args[4], nt, types.uint32)
            _asm(builder, [ir.IntType(32), ir.IntType(64), ir.IntType(32)], ir.VoidType(),
                 "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", [dst, glob, size], True)
            return context.get_dummy_value()

        return sig, codegen

    def _barrier_asm(template):
        @intrinsic
        def barrier(typingctx):
            sig = types.void()

            def codegen(context, builder, signature, args):
                _asm(builder, [], ir.VoidType(), template, "~{memory}", [], True)
                return context.get_dummy_value()

            return sig, codegen

        return barrier

    cp_async_commit = _barrier_asm("cp.async.commit_group;")
    cp_async_wait_all = _barrier_asm("cp.async.wait_group 0;")
    cp_async_wait_one = _barrier_asm("cp.async.wait_group 1;")

    def _pack(kind):
        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                lo_v, hi_v = (context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args))
                # cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the upper half and b in the lower.
                return _asm(builder, [ir.FloatType(), ir.FloatType()], ir.IntType(32),
                            f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f", [hi_v, lo_v], False)

            return sig, codegen

        return pack

    pack_f16 = _pack("f16")
    pack_bf16 = _pack("bf16")

    @intrinsic
    def ex2(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            return _asm(builder, [ir.FloatType()], ir.FloatType(), "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                        [context.cast(builder, args[0], signature.args[0], types.float32)], False)

        return sig, codegen

    @intrinsic
    def float_bits(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    @intrinsic
    def bits_float(typingctx, u):
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen
