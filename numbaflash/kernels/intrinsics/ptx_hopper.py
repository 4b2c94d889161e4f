"""Hopper's warpgroup tensor-core instructions (sm_90a) as numba intrinsics; emulated in `emulated_hopper`.

A wgmma's accumulators are a thread's local float32 fragment array: the intrinsic loads every element
by a constant index before the instruction and stores it back after, so once NVVM inlines the kernel
the array lives in registers (ptxas: no local memory, HGMMA in SASS). The instruction is asynchronous;
ptxas knows which registers an in-flight wgmma owns, and the kernels touch them only after
``wgmma_wait*`` (where they do not, ptxas would serialize the wgmma and warn).
"""

import functools

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .ptx import _asm, _barrier_asm, _element_pointer, _indexes, _shared_address

KIND = {"float16": "f16", "bfloat16": "bf16"}

wgmma_fence = _barrier_asm("wgmma.fence.sync.aligned;")
wgmma_commit = _barrier_asm("wgmma.commit_group.sync.aligned;")
wgmma_wait0 = _barrier_asm("wgmma.wait_group.sync.aligned 0;")
wgmma_wait1 = _barrier_asm("wgmma.wait_group.sync.aligned 1;")
fence_proxy_async = _barrier_asm("fence.proxy.async.shared::cta;")


@intrinsic
def shared_address(typingctx, smem, i):
    if not isinstance(smem, types.Array) or smem.ndim != 1:
        return None
    sig = types.uint32(smem, i)

    def codegen(context, builder, signature, args):
        return _shared_address(context, builder, signature.args[0], args[0], args[1], signature.args[1])

    return sig, codegen


def _fragments(context, builder, aryty, ary_value, count, first=0):
    """Pointers to ``count`` float32 of a C-contiguous local array from flat element ``first``, by constant
    index."""
    data = context.make_array(aryty)(context, builder, ary_value).data
    return [builder.gep(data, [ir.Constant(ir.IntType(32), first + i)]) for i in range(count)]


def _is_fragment_array(acc):
    return isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.layout == "C"


def _wgmma(builder, pointers, operand_types, operand_constraints, operands, text, fresh=False):
    """``fresh``: the product overwrites the accumulators (scale-d false), so their old values are not inputs
    and need not stay live before it (in a loop, across the back edge)."""
    f32 = ir.FloatType()
    count = len(pointers)
    values = [] if fresh else [builder.load(p) for p in pointers]
    res = _asm(builder, operand_types + [f32] * len(values), ir.LiteralStructType([f32] * count), text,
               ",".join(["=f"] * count + operand_constraints + [str(i) for i in range(len(values))]),
               operands + values, True)
    for i, p in enumerate(pointers):
        builder.store(builder.extract_value(res, i), p)


@functools.lru_cache(maxsize=None)
def wgmma_ss(n, storage, mn_major=False, fresh=False):
    count, kind = n // 2, KIND[storage]
    regs = ",".join(f"${i}" for i in range(count))
    # scale-d is a predicate: 0 overwrites the accumulators (the first k-step of a product), 1 adds; ``fresh``
    # always overwrites, and the accumulators' old values are not the instruction's inputs (`_wgmma`). With
    # ``mn_major`` both operands are transposed (imm-trans-a = imm-trans-b = 1): A's M and B's N run along rows.
    trans = int(mn_major)
    scale_d = "setp.ne.b32 p, 0, 0;" if fresh else f"setp.ne.b32 p, ${count + 2}, 0;"
    text = (f"{{ .reg .pred p; {scale_d} wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "
            f"{{{regs}}}, ${count}, ${count + 1}, p, 1, 1, {trans}, {trans}; }}")

    @intrinsic
    def ss(typingctx, acc, smem, desc_a, desc_b, accumulate):
        if not _is_fragment_array(acc):
            return None
        sig = types.void(acc, smem, types.uint64, types.uint64, types.int32)

        def codegen(context, builder, signature, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            flag = context.cast(builder, args[4], signature.args[4], types.int32)
            _wgmma(builder, _fragments(context, builder, signature.args[0], args[0], count), [i64, i64, i32],
                   ["l", "l", "r"], [args[2], args[3], flag], text, fresh)
            return context.get_dummy_value()

        return sig, codegen

    return ss


@functools.lru_cache(maxsize=None)
def wgmma_rs(n, storage, first=0):
    count, kind = n // 2, KIND[storage]
    regs = ",".join(f"${i}" for i in range(count))
    # B MN-major (imm-trans-b = 1): V as it sits in memory, keys along K and the head dim along N.
    text = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{regs}}}, "
            f"{{${count},${count + 1},${count + 2},${count + 3}}}, ${count + 4}, 1, 1, 1, 1;")

    @intrinsic
    def rs(typingctx, acc, a0, a1, a2, a3, smem, desc_b):
        if not _is_fragment_array(acc):
            return None
        u = types.uint32
        sig = types.void(acc, u, u, u, u, smem, types.uint64)

        def codegen(context, builder, signature, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[1:5], signature.args[1:5])]
            _wgmma(builder, _fragments(context, builder, signature.args[0], args[0], count, first), [i32] * 4 + [i64],
                   ["r"] * 4 + ["l"], words + [args[6]], text)
            return context.get_dummy_value()

        return sig, codegen

    return rs


def _mbarrier_codegen(template, returns):
    """Codegen of an op on the mbarrier at ``smem[i]``: ``template`` names its address ``$A`` and the u32
    operands after it ``$X0, ...``; a returning op writes ``$0``."""
    i32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        address = _shared_address(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], signature.args[2:])]
        first = 1 if returns else 0
        text = template.replace("$A", f"${first}")
        for k in range(len(values)):
            text = text.replace(f"$X{k}", f"${first + 1 + k}")
        constraints = (["=r"] if returns else []) + ["r"] * (1 + len(values)) + ["~{memory}"]
        res = _asm(builder, [i32] * (1 + len(values)), i32 if returns else ir.VoidType(), text,
                   ",".join(constraints), [address] + values, True)
        return res if returns else context.get_dummy_value()

    return codegen


def _is_shared_words(smem):
    return isinstance(smem, types.Array) and smem.ndim == 1


def _mbarrier_op(template):
    """``op(smem, i)`` on the mbarrier in the 8 bytes at ``smem[i]`` (8-byte aligned)."""
    @intrinsic
    def op(typingctx, smem, i):
        return (types.void(smem, i), _mbarrier_codegen(template, False)) if _is_shared_words(smem) else None

    return op


def _mbarrier_op_u32(template, returns):
    """``op(smem, i, x)``: an mbarrier op with one u32 operand, returning a u32 or nothing."""
    @intrinsic
    def op(typingctx, smem, i, x):
        if not _is_shared_words(smem):
            return None
        return (returns or types.void)(smem, i, types.uint32), _mbarrier_codegen(template, returns is not None)

    return op


mbarrier_init = _mbarrier_op_u32("mbarrier.init.shared::cta.b64 [$A], $X0;", None)
mbarrier_arrive = _mbarrier_op("mbarrier.arrive.shared::cta.b64 _, [$A];")
# Counts as one of the barrier's expected arrivals once every earlier cp.async of this thread has landed.
cp_async_mbarrier_arrive = _mbarrier_op("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$A];")
mbarrier_try_wait = _mbarrier_op_u32(
    "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$A], $X0; selp.u32 $0, 1, 0, p; }", types.uint32)


def _setmaxnreg(kind, count):
    return _barrier_asm(f"setmaxnreg.{kind}.sync.aligned.u32 {count};")


@functools.lru_cache(maxsize=None)
def setmaxnreg_inc(count):
    """``setmaxnreg.inc`` to ``count`` registers per thread (a multiple of 8, 24 to 256), for the whole warpgroup."""
    return _setmaxnreg("inc", count)


@functools.lru_cache(maxsize=None)
def setmaxnreg_dec(count):
    return _setmaxnreg("dec", count)


mbarrier_arrive_expect_tx = _mbarrier_op_u32("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$A], $X0;", None)
TENSOR_MAPS = None  # the simulator's registry of map sets (`emulated_hopper`); on a GPU maps are in device memory


@intrinsic
def tensormap_acquire(typingctx, maps, which):
    """Make map ``which`` of the map set at ``maps`` (written by the host before the launch) visible to this
    thread's bulk tensor copies. Once per thread and map: compiled into every copy, the acquire invalidated the
    cached descriptor (``UTMACCTL.IV``) and waited for every outstanding load, so each copy fetched its map from
    global memory again. Without a ``prefetch.tensormap`` after it, which the first copy makes redundant, 8
    documents' v5 forward ran 0.269 -> 0.260 ms and its two backward passes 0.469 -> 0.452 and 0.327 -> 0.318
    (headdim 64, N = 16384, 16 heads; dense causal unchanged; H100, kernel times, .bench/bwd_split2.py, two runs
    each). The acquire itself stays: the CUDA guide asks every block to fence a map the host copied to global
    memory (without it the dense dK/dV pass ran 4% faster too)."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        tmap = builder.add(args[0], builder.mul(args[1], ir.Constant(ir.IntType(64), 128)))
        _asm(builder, [ir.IntType(64)], ir.VoidType(),
             "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l,~{memory}", [tmap],
             True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tma_load_4d(typingctx, smem, dst, maps, which, c0, c1, c2, c3, barrier):
    """Copy the box of map ``which`` of the map set at ``maps`` whose first element is at coordinates (c0 head
    dim, c1 head, c2 row, c3 batch) into ``smem[dst ..]`` (1024-byte aligned), completing its bytes on the
    mbarrier at ``smem[barrier]``. The map is read through a generic address: `tensormap_acquire` it first."""
    if not _is_shared_words(smem):
        return None
    i32 = types.int32
    sig = types.void(smem, dst, types.int64, types.int64, i32, i32, i32, i32, barrier)

    def codegen(context, builder, signature, args):
        st = signature.args[0]
        dst_address = _shared_address(context, builder, st, args[0], args[1], signature.args[1])
        bar_address = _shared_address(context, builder, st, args[0], args[8], signature.args[8])
        i64 = ir.IntType(64)
        tmap = builder.add(args[2], builder.mul(args[3], ir.Constant(i64, 128)))
        coords = [context.cast(builder, v, t, types.int32) for v, t in zip(args[4:8], signature.args[4:8])]
        _asm(builder, [ir.IntType(32), i64] + [ir.IntType(32)] * 5, ir.VoidType(),
             "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
             "[$0], [$1, {$2, $3, $4, $5}], [$6];", "r,l,r,r,r,r,r,~{memory}",
             [dst_address, tmap] + coords + [bar_address], True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bulk_load(typingctx, smem, dst, src, i, nbytes, barrier):
    """Copy ``nbytes`` (a multiple of 16) of global array ``src`` from its element ``i`` (a tuple of indices; the
    bytes from there on must be ``src``'s) into ``smem[dst ..]``, both 16-byte aligned, through the bulk copy
    engine (``cp.async.bulk``, no tensor map), completing the bytes on the mbarrier at ``smem[barrier]``."""
    if not (_is_shared_words(smem) and isinstance(src, types.Array) and _indexes(src, i)):
        return None
    sig = types.void(smem, dst, src, i, types.int32, barrier)

    def codegen(context, builder, signature, args):
        st = signature.args[0]
        dst_address = _shared_address(context, builder, st, args[0], args[1], signature.args[1])
        bar_address = _shared_address(context, builder, st, args[0], args[5], signature.args[5])
        source = builder.ptrtoint(_element_pointer(context, builder, signature.args[2], args[2], args[3],
                                                   signature.args[3]), ir.IntType(64))
        i32 = ir.IntType(32)
        _asm(builder, [i32, ir.IntType(64), i32, i32], ir.VoidType(),
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
             "r,l,r,r,~{memory}", [dst_address, source, args[4], bar_address], True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def red_add2(typingctx, arr, i, x, y):
    """``arr[i] += x`` and the next element ``+= y``, atomically, by one ``red.global.add.v2.f32`` (sm_90; no
    value returned, so nothing waits for it); ``i`` indexes a float32 global array, its last index even."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and _indexes(arr, i)):
        return None
    sig = types.void(arr, i, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        address = builder.ptrtoint(ptr, ir.IntType(64))
        values = [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:], signature.args[2:])]
        _asm(builder, [ir.IntType(64), ir.FloatType(), ir.FloatType()], ir.VoidType(),
             "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}", [address] + values, True)
        return context.get_dummy_value()

    return sig, codegen
