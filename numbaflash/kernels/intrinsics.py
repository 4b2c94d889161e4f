"""Device operations numba does not offer, written in pure Numba, each with a simulator emulation.

On a GPU these are `numba.cuda.extending.intrinsic`s that emit LLVM IR or inline PTX. Under the CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) the same names are plain Python functions with the same
semantics, so every kernel that uses them runs in CI on the CPU. Warp-collective operations (shuffles)
emulate the warp with a per-warp exchange: each lane deposits its operand, the 32 lanes meet at a
barrier, and each lane reads what the hardware would have routed to it.

* ``shfl_xor(value, lane_mask)``: butterfly shuffle of a 32- or 64-bit value across the full warp.
* ``group_max(value, width)``, ``group_sum(value, width)``: reduce over each aligned group of ``width``
  lanes (a power of two dividing 32) and give every lane the result: a butterfly of shuffles on the
  GPU, one exchange under the simulator.
* ``load2(arr, i)``, ``load4(arr, i)``: one vector load of n consecutive elements as a tuple: of a 1-D
  array from ``arr[i]``, or of an N-D one from ``arr[i]`` with ``i`` a tuple of indices (the last
  index runs). The caller guarantees alignment to the vector's size (at most 16 bytes). On shared
  memory this is one ``ld.shared.v4`` instead of n scalar loads, which keeps the register-tiled loops
  fed; on global memory it is one 16-byte load per thread.
* ``store4(arr, i, values)``: the matching vector store.
* ``float_bits(x)`` / ``bits_float(u)``: reinterpret float32 <-> uint32 (for bfloat16 conversion).

``device_function(fn)`` makes a plain Python function callable from kernels and from other device
functions: registered with numba as a CUDA overload of itself, inlined at the Numba IR level (so a
register array a kernel passes in is still indexed by constants after inlining and stays in registers),
on a GPU; left as is under the simulator (where kernels are Python too). Either way it returns ``fn``,
which stays callable from Python.
"""

import threading

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_function(fn):
    if not SIMULATOR:
        from numba.cuda.extending import register_jitable

        register_jitable(inline="always")(fn)
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

    def _exchange(value):
        """All lanes of the calling thread's warp deposit ``value``; each gets every lane's value."""
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
        slots = warp.buffers[warp.generation[lane] % 2]
        warp.generation[lane] += 1
        slots[lane] = value
        warp.barrier.wait()
        return slots, lane

    def shfl_xor(value, lane_mask):
        lanes, lane = _exchange(value)
        return lanes[lane ^ lane_mask]

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

    def store4(arr, i, values):
        arr[i], arr[i + 1], arr[i + 2], arr[i + 3] = values

    def float_bits(x):
        return np.array(x, dtype=np.float32).view(np.uint32)[()]

    def bits_float(u):
        return np.array(u, dtype=np.uint32).view(np.float32)[()]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @device_function
    def shfl_xor(value, lane_mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

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

    @intrinsic
    def store4(typingctx, arr, i, values):
        if not isinstance(arr, types.Array) or arr.ndim != 1:
            return None
        sig = types.void(arr, i, values)

        def codegen(context, builder, sig, args):
            aryty, ity, valty = sig.args
            ptr = _element_pointer(context, builder, aryty, args[0], args[1], ity)
            element = context.get_data_type(aryty.dtype)
            vec = ir.Constant(ir.VectorType(element, 4), ir.Undefined)
            for k in range(4):
                value = context.cast(builder, builder.extract_value(args[2], k), valty[k], aryty.dtype)
                vec = builder.insert_element(vec, value, ir.Constant(ir.IntType(32), k))
            size = 4 * context.get_abi_sizeof(element)
            builder.store(vec, builder.bitcast(ptr, vec.type.as_pointer()), align=min(size, 16))
            return context.get_dummy_value()

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
