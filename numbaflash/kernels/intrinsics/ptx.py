"""The intrinsics on a GPU: numba `intrinsic`s that emit LLVM IR or inline PTX.

Their simulator emulations, with the same names and semantics, are in `emulated`; the package's
``__init__`` picks one module or the other.
"""

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from .polynomials import EX2_FMA_COEFFICIENTS, EX2_FMA_F16X2_COEFFICIENTS, EX2_FMA_F16X2_FLOOR, EX2_FMA_F16X2_MAGIC
from .target import device_function

@device_function
def group_max(value, width):
    offset = width // 2
    while offset > 0:
        value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, offset))
        offset //= 2
    return value

@device_function
def warp_any(predicate):
    return cuda.any_sync(0xFFFFFFFF, predicate)

@device_function
def group_sum(value, width):
    offset = width // 2
    while offset > 0:
        value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
        offset //= 2
    return value

@device_function
def warp_uniform(value):
    return cuda.shfl_sync(0xFFFFFFFF, value, 0)

def _element_pointer(context, builder, aryty, ary_value, index_value, index_type, trailing=()):
    # ``trailing``: intp values appended to the indices (`store2_row`'s row start)
    ary = context.make_array(aryty)(context, builder, ary_value)
    if isinstance(index_type, types.BaseTuple):
        indices = [context.cast(builder, builder.extract_value(index_value, d), index_type[d], types.intp)
                   for d in range(len(index_type))]
    else:
        indices = [context.cast(builder, index_value, index_type, types.intp)]
    return cgutils.get_item_pointer(context, builder, aryty, ary, indices + list(trailing), wraparound=False)

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

def _store_pair(context, builder, ptr, dtype, values):
    element = context.get_data_type(dtype)
    vec = ir.Constant(ir.VectorType(element, 2), ir.Undefined)
    for k, value in enumerate(values):
        vec = builder.insert_element(vec, value, ir.Constant(ir.IntType(32), k))
    builder.store(vec, builder.bitcast(ptr, vec.type.as_pointer()), align=2 * context.get_abi_sizeof(element))

@intrinsic
def store2(typingctx, arr, i, lo, hi):
    if not isinstance(arr, types.Array) or not _indexes(arr, i):
        return None
    sig = types.void(arr, i, arr.dtype, arr.dtype)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        _store_pair(context, builder, ptr, sig.args[0].dtype, args[2:])
        return context.get_dummy_value()

    return sig, codegen

@intrinsic
def store2_row(typingctx, arr, i, col, lo, hi):
    # The row's address from every index but the last, then ``col`` as an element offset: where ``col`` is a constant
    # plus a lane's part, each store of a row takes an immediate offset from one address instead of a 64-bit
    # product with the last axis's run-time stride (`fragments.fragment_writer`).
    if not (isinstance(arr, types.Array) and isinstance(i, types.BaseTuple) and len(i) == arr.ndim - 1
            and all(isinstance(t, types.Integer) for t in i) and isinstance(col, types.Integer)):
        return None
    sig = types.void(arr, i, col, arr.dtype, arr.dtype)

    def codegen(context, builder, sig, args):
        row = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                               trailing=(context.get_constant(types.intp, 0),))
        ptr = builder.gep(row, [context.cast(builder, args[2], sig.args[2], types.intp)])
        _store_pair(context, builder, ptr, sig.args[0].dtype, args[3:])
        return context.get_dummy_value()

    return sig, codegen

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

def _pair_f32(template):
    """An intrinsic ``(lo, hi)`` -> uint32 of two float32 through ``template``, which takes hi as $1 and lo as $2."""
    @intrinsic
    def pair(typingctx, lo, hi):
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            lo_v, hi_v = (context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args))
            return _asm(builder, [ir.FloatType(), ir.FloatType()], ir.IntType(32), template, "=r,f,f", [hi_v, lo_v],
                        False)

        return sig, codegen

    return pair

# cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the upper half and b in the lower.
pack_f16 = _pair_f32("cvt.rn.f16x2.f32 $0, $1, $2;")
pack_bf16 = _pair_f32("cvt.rn.bf16x2.f32 $0, $1, $2;")

def _unary_f32(template):
    @intrinsic
    def unary(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            return _asm(builder, [ir.FloatType()], ir.FloatType(), template, "=f,f",
                        [context.cast(builder, args[0], signature.args[0], types.float32)], False)

        return sig, codegen

    return unary


ex2 = _unary_f32("ex2.approx.ftz.f32 $0, $1;")
rcp = _unary_f32("rcp.approx.ftz.f32 $0, $1;")
tanh_approx = _unary_f32("tanh.approx.f32 $0, $1;")

def _f32_hex(value):
    return "0f%08X" % np.float32(value).view(np.uint32)


_C1, _C2, _C3 = (_f32_hex(c) for c in EX2_FMA_COEFFICIENTS)
ex2_fma = _unary_f32(
    "{ .reg .f32 x, t, j, f, p, e; .reg .b32 tb;\n"
    "max.NaN.f32 x, $1, 0fC2FE0000;\n"  # at least -127 (2^-127 becomes 0 below); NaN stays NaN
    "add.rm.f32 t, x, 0f4B40007F;\n"  # 1.5 x 2^23 + 127 + floor(x): 127 + floor(x) in the low mantissa bits
    "sub.f32 j, t, 0f4B40007F;\n"
    "sub.f32 f, x, j;\n"
    f"fma.rn.f32 p, f, {_C3}, {_C2};\n"
    f"fma.rn.f32 p, p, f, {_C1};\n"
    "fma.rn.f32 p, p, f, 0f3F800000;\n"  # 2^f
    "mov.b32 tb, t;\n"
    "shl.b32 tb, tb, 23;\n"  # the exponent field 127 + floor(x): 2^floor(x), 0 for -127
    "mov.b32 e, tb;\n"
    "mul.f32 $0, p, e; }")

def _f16x2_hex(value):
    half = int(np.float16(value).view(np.uint16))
    return "0x%08X" % (half << 16 | half)


_H0, _H1, _H2, _H3 = (_f16x2_hex(c) for c in EX2_FMA_F16X2_COEFFICIENTS)


ex2_fma_f16x2 = _pair_f32(
    "{ .reg .b32 x, t, j, f, p, e, c;\n"
    "cvt.rn.f16x2.f32 x, $1, $2;\n"  # hi in the upper half
    f"mov.b32 c, {_f16x2_hex(EX2_FMA_F16X2_FLOOR)};\n"
    "max.NaN.f16x2 x, x, c;\n"  # at least -22 (2^-22 becomes 0 below); NaN stays NaN
    f"mov.b32 c, {_f16x2_hex(EX2_FMA_F16X2_MAGIC)};\n"  # 1.5 x 2^10 + 22: 22 + round(x) in the low mantissa bits
    "add.rn.f16x2 t, x, c;\n"
    "sub.rn.f16x2 j, t, c;\n"
    "sub.rn.f16x2 f, x, j;\n"  # in [-1/2, 1/2]
    f"mov.b32 c, {_H3};\n"
    f"mov.b32 p, {_H2};\n"
    "fma.rn.f16x2 p, f, c, p;\n"
    f"mov.b32 c, {_H1};\n"
    "fma.rn.f16x2 p, p, f, c;\n"
    f"mov.b32 c, {_H0};\n"
    "fma.rn.f16x2 p, p, f, c;\n"  # 2^-7 2^f
    "shl.b32 e, t, 10;\n"  # each half's exponent field 22 + round(x): 2^(round(x) + 7), 0 at -22
    "and.b32 e, e, 0x7C007C00;\n"
    "mul.rn.f16x2 $0, p, e; }")


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


def _named_barrier(op):
    @intrinsic
    def barrier(typingctx, barrier, threads):
        sig = types.void(barrier, threads)

        def codegen(context, builder, signature, args):
            operands = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args)]
            _asm(builder, [ir.IntType(32)] * 2, ir.VoidType(), f"{op} $0, $1;", "r,r,~{memory}", operands, True)
            return context.get_dummy_value()

        return sig, codegen

    return barrier


# Named barriers 1-15 (0 is syncthreads'): ``threads`` (a multiple of 32) arrivals complete one.
named_barrier_sync = _named_barrier("bar.sync")
named_barrier_arrive = _named_barrier("bar.arrive")
