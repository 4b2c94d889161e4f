"""The public API: `attention`, `attention_backward`, `plan` and `explain`, with every check at the boundary."""

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from numba.core.errors import NumbaError

from . import _arrays, arguments, call_cache, masks, tiling
from .block_sparsity import BlockMask
from .mods import NONE, Mods, check as check_mods
from .kernels import compiled, function_keys
from .kernels import mods as kernel_mods
from .kernels.mma import backward as mma_backward, forward as mma_forward
from .kernels.simt import backward as simt_backward, forward as simt_forward
from .kernels.wgmma import (backward as wgmma_backward, forward as wgmma_forward, ws_backward as wgmma_ws_backward,
                            ws_forward as wgmma_ws_forward)
from .kernels.elements import STORAGE
from .kernels.intrinsics import SIMULATOR

MAX_HEADDIM = 256
LOG2E = math.log2(math.e)


@dataclass
class Call:
    """A validated call: 4-D operands and the sizes and options the kernels need."""

    q: _arrays.Operand
    k: _arrays.Operand
    v: _arrays.Operand
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    softmax_scale: float
    left: int
    right: int
    single_head: bool
    mods: Mods = NONE
    softcap: float = 0.0
    mod_values: tuple = ()  # the kernels' ``mod`` argument (`kernels.mods.values`), less a forward's block-mask table
    block_mask: BlockMask = None
    # What was worked out for this layout (`call_cache`): shared by every call of it; None: not remembered.
    memo: dict = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def device(self):
        return self.q.device

    def remembered(self, key, make):
        """``make()``, worked out once per layout under ``key`` where the layout is remembered."""
        if self.memo is None:
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @property
    def lse_dtype(self):
        return tiling.accumulator(self.dtype)


def _check_scale(softmax_scale, headdim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale must be a number or None (1/sqrt(headdim)); got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number (any sign, as in flash-attn); got {softmax_scale!r}")
    return scale


def _check_accumulator_range(scale, softcap, dtype):
    """softmax_scale and softcap whose derived values the kernels hold in the accumulator type: softmax_scale *
    log2(e) and softcap * log2(e) (the softmax's scales), and softmax_scale / softcap (tanh's argument's: a
    subnormal softcap's reciprocal is inf in float32, and tanh(0 * inf) NaN)."""
    accumulator = tiling.accumulator(dtype)
    limits = np.finfo(accumulator)
    largest = float(limits.max) / LOG2E
    if abs(scale) > largest:
        raise ValueError(f"softmax_scale must be at most {largest:.4g} in magnitude for {dtype} inputs, whose scores "
                         f"the kernels scale by softmax_scale * log2(e) in {accumulator}; got {scale!r}")
    least = max(float(limits.tiny), abs(scale) / float(limits.max))
    if softcap != 0 and not least <= softcap <= largest:
        raise ValueError(f"softcap must be 0 (off) or between {least:.4g} and {largest:.4g} for {dtype} inputs with "
                         f"softmax_scale {scale:.4g}: the kernels hold softcap * log2(e) and softmax_scale / softcap "
                         f"in {accumulator}; got {softcap!r}")


NAMES = ("q", "k", "v")


def describe_operands(q, k, v, names=NAMES):
    """q, k, v as `_arrays.Operand`s; TypeError where host and device arrays mix or one is not an array."""
    nq, nk, nv = names
    on_host = [isinstance(x, np.ndarray) for x in (q, k, v)]
    on_device = [not h and _arrays.is_device_array(x) for h, x in zip(on_host, (q, k, v))]
    if any(on_host) and any(on_device):
        raise TypeError(f"{nq}, {nk}, {nv} mix host (NumPy) and device arrays; pass all three on the GPU")
    return [_arrays.describe(x, n) for x, n in zip((q, k, v), names)]


def inspect(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), names=NAMES, modifications=None,
            backward=False):
    """Validate a call and describe it; ValueError/TypeError messages name the problem and what is accepted.

    ``modifications``: the keyword arguments of `MODIFICATIONS` (`numbaflash.mods`); ``backward``: whether
    the call differentiates through them.
    """
    return inspect_operands(describe_operands(q, k, v, names), causal, softmax_scale, window_size, names,
                            modifications, backward)


def inspect_operands(ops, causal=False, softmax_scale=None, window_size=(-1, -1), names=NAMES, modifications=None,
                     backward=False):
    """`inspect` of q, k, v already described (`describe_operands`, or a varlen call's batch views of them)."""
    nq, nk, nv = names
    layout, mod_arrays = (call_cache.key(ops, causal, softmax_scale, window_size, modifications, backward)
                          if names == NAMES else (None, None))
    known = call_cache.get(layout)
    if known is not None:
        call = Call.__new__(Call)  # 0.4 us where copy.copy took 1.6 and dataclasses.replace 2.5 (this host)
        call.__dict__.update(known.__dict__)
        call.q, call.k, call.v = ops
        if mod_arrays:  # this call's slopes and mod_args, of the layouts checked before
            slopes = mod_arrays[0] if call.mods.alibi else None
            call.mod_values = _mod_values(call, call.softcap, slopes, mod_arrays[slopes is not None:])
        return call
    ndims = [len(op.shape) for op in ops]
    if not (all(n == 4 for n in ndims) or all(n == 2 for n in ndims)):
        raise ValueError(f"{nq}, {nk}, {nv} must all be 4-D (batch, seqlen, nheads, headdim) or all 2-D "
                         f"(seqlen, headdim); got ndim {ndims[0]}, {ndims[1]}, {ndims[2]}")
    devices = [op.device for op in ops]
    if len(set(devices)) > 1:
        raise ValueError(f"{nq}, {nk}, {nv} are on different GPUs ({devices[0]}, {devices[1]}, {devices[2]}); "
                         "put them on one device")
    dtypes = [op.dtype for op in ops]
    if len(set(dtypes)) > 1:
        raise TypeError(f"{nq}, {nk}, {nv} must share one dtype; got {dtypes[0]}, {dtypes[1]}, {dtypes[2]}")
    if dtypes[0] not in STORAGE:
        raise TypeError(f"dtype {dtypes[0]} is not supported; use one of {', '.join(STORAGE)}")
    single_head = ndims[0] == 2
    if single_head:
        ops = [_arrays.single_head_view(op, n) for op, n in zip(ops, names)]
    (batch, seqlen_q, nheads, headdim), (kb, seqlen_k, nheads_kv, kd) = ops[0].shape, ops[1].shape
    if ops[1].shape != ops[2].shape:
        raise ValueError(f"{nk} and {nv} must have the same shape (batch, seqlen_k, nheads_kv, headdim); "
                         f"got {ops[1].shape} and {ops[2].shape}")
    if kb != batch:
        raise ValueError(f"batch of {nq} ({batch}) and of {nk}, {nv} ({kb}) differ")
    if kd != headdim:
        raise ValueError(f"headdim of {nq} ({headdim}) and of {nk}, {nv} ({kd}) differ")
    if 0 in (batch, seqlen_q, seqlen_k, nheads, nheads_kv):
        raise ValueError(f"empty input: batch={batch}, seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, nheads={nheads}, "
                         f"nheads_kv={nheads_kv}; every size must be at least 1")
    if nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) for grouped-query attention")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}; got {headdim}")
    arguments.flag(causal, "causal")
    left, right = masks.normalize_window(causal, arguments.window(window_size))
    scale = _check_scale(softmax_scale, headdim)
    call = Call(*ops, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtypes[0], scale, left, right, single_head)
    modifications = {**MODIFICATIONS, **(modifications or {})}
    block = modifications.pop("block_mask")
    if block is not None:
        modifications["mask_mod"] = _check_block_mask(block, modifications["mask_mod"], call)
    modified, softcap, slopes, mod_args = check_mods(**modifications, describe=_boundary_array(call), batch=batch,
                                                     nheads=nheads, backward=backward)
    _check_accumulator_range(scale, softcap, dtypes[0])
    if block is not None:
        modified = dataclasses.replace(modified, block_sparse=True)
    call.block_mask = block
    call.mods = modified
    call.softcap = softcap  # the call cache's key holds it: a call it remembers has the same
    call.mod_values = _mod_values(call, softcap, slopes, mod_args)
    if layout is not None:
        call.memo = {}
        kept_values = None if slopes is not None or mod_args else call.mod_values  # no array of the call is kept
        call_cache.put(layout, dataclasses.replace(call, q=None, k=None, v=None, mod_values=kept_values))
    return call


def _mod_values(call, softcap, slopes, mod_args):
    """The kernels' ``mod`` argument (`kernels.mods.values`) from checked modifications: ``slopes`` and
    ``mod_args`` `_arrays.Operand`s."""
    if slopes is not None and len(slopes.shape) == 1:
        slopes = _arrays.describe(slopes.obj[None, :], "alibi_slopes")  # (1, nheads): one row for every batch element
    return kernel_mods.values(call.mods, softcap, slopes, tuple(mod_args), _accumulator_scalar(call))


# The modification keyword arguments of attention and attention_backward, and their defaults (off).
MODIFICATIONS = dict(softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(),
                     block_mask=None)


def _check_block_mask(block, mask_mod, call):
    """The mask_mod a call with ``block`` runs: the block mask's own (the call's mask_mod, if given, must be it)."""
    if not isinstance(block, BlockMask):
        raise TypeError(f"block_mask must be None or what numbaflash.block_mask(...) returns; got {type(block).__name__}")
    block.check_sizes(call.batch, call.nheads, call.seqlen_q, call.seqlen_k)
    if mask_mod is not None and mask_mod is not block.mask_mod:
        raise ValueError("mask_mod differs from the block_mask's own: pass one or the other (the block mask carries it)")
    return block.mask_mod


def _boundary_array(call):
    """`_arrays.describe` for the call's extra arrays (slopes, mod_args): on q's side (host or device) and device."""
    def describe(x, name):
        if isinstance(x, np.ndarray) != (call.q.kind == "numpy"):
            raise TypeError(f"{name} must be an array of the same kind as q ({call.q.kind}: on the "
                            f"{'host' if call.q.kind == 'numpy' else 'GPU'}); got {type(x).__module__}.{type(x).__name__}")
        op = _arrays.describe(x, name)
        if op.device != call.device:
            raise ValueError(f"{name} is on device {op.device}, q on device {call.device}: put them on one device")
        return op
    return describe


def _accumulator_scalar(call):
    return np.float64 if call.dtype == "float64" else np.float32


def _plan_for(call, backward, device=None, dout=None, deterministic=True, lse=True, tiles=None):
    """The plan of ``call`` on ``device`` (default: the GPU its operands are on, current under `_device_context`,
    where the plan is remembered with the layout); a backward's ``dout`` counts for the alignment its copies need;
    ``lse``: the caller takes the forward's LSE (`tiling.make_plan`); ``tiles``: blocks in place of the planned ones."""
    aligned = call.remembered("aligned", lambda: all(op.vector_aligned(8) for op in (call.q, call.k, call.v)))
    aligned = aligned and (dout is None or dout.vector_aligned(8))
    if device is not None or tiles is not None:
        return _make_plan(call, backward, device or tiling.current_device(call.device), aligned, deterministic, lse,
                          tiles)
    return call.remembered(("plan", backward, aligned, deterministic, lse), lambda: _make_plan(
        call, backward, tiling.current_device(call.device), aligned, deterministic, lse))


def _make_plan(call, backward, device, aligned, deterministic, lse, tiles=None):
    return tiling.make_plan(call.batch, call.nheads, call.nheads_kv, call.seqlen_q, call.seqlen_k, call.headdim,
                            call.dtype, backward=backward, device=device, tiles=tiles, aligned=aligned,
                            packed=call.mods.packed,
                            user_functions=call.mods.per_score_functions, deterministic=deterministic,
                            softcap_alone=call.mods.softcap_alone, block_sparse=call.mods.block_sparse,
                            alibi_alone=call.mods.alibi_alone, lse=lse, softcap=call.softcap,
                            block_visits=None if backward else _block_visits(call))


def _block_visits(call):
    """The mean key tiles a forward block of `tiling.block_visits_tiles` visits under ``call``'s block mask (None
    without one, or where no plan asks)."""
    tiles = tiling.block_visits_tiles(call.headdim)
    if call.block_mask is None or tiles is None:
        return None
    return call.block_mask.mean_visits(*tiles, call.left, call.right)


def _check_plan(plan, call, direction, lse=False):
    """``plan`` as the caller gave it, for ``call`` in ``direction``; ``lse``: the caller takes the LSE, which a plan
    whose tensor cores sum P's rows (`wgmma.row_sums`) does not give exactly."""
    if not isinstance(plan, tiling.Plan):
        raise TypeError(f"plan must be None or what numbaflash.plan(...) returns (a numbaflash.tiling.Plan); "
                        f"got {type(plan).__name__}")
    if lse and getattr(plan.tiles, "row_sums", False):
        raise ValueError("plan sums P's rows on the tensor cores (tiles.row_sums), which gives no exact LSE: call "
                         "without return_lse, or with numbaflash.plan(..., return_lse=True)'s plan")
    if getattr(plan.tiles, "bounded_max", False) and call.mods.softcap_alone and not tiling.fixed_maximum(
            call.dtype, call.softcap):
        raise ValueError(f"plan takes softcap's bound for each row's maximum (tiles.bounded_max), which holds for "
                         f"bfloat16 with softcap * log2(e) <= {tiling.BOUNDED_MAX_LOG2:g}; got {call.dtype}, softcap "
                         f"{call.softcap:g}: make the call's plan with numbaflash.plan(..., softcap=its softcap)")
    expected = (direction, call.dtype, call.batch, call.nheads, call.nheads_kv, call.seqlen_q, call.seqlen_k, call.headdim)
    got = (plan.direction, plan.dtype, plan.batch, plan.nheads, plan.nheads_kv, plan.seqlen_q, plan.seqlen_k, plan.headdim)
    if got != expected:
        raise ValueError(f"plan was made for (direction, dtype, batch, nheads, nheads_kv, seqlen_q, seqlen_k, "
                         f"headdim) = {got}, not for this call's {expected}")
    return plan


def _device_context(call):
    """The operands' GPU current while a call runs: numba's context push costs about 10 microseconds, so it is
    pushed only where another context is current (torch and CuPy leave the device's primary one current)."""
    if SIMULATOR or _current_context() == _primary_context(call.device):
        return contextlib.nullcontext()
    from numba import cuda

    return cuda.gpus[call.device]


def _current_context():
    from cuda.bindings import driver

    error, context = driver.cuCtxGetCurrent()
    return int(context) if error == driver.CUresult.CUDA_SUCCESS else None


@functools.lru_cache(maxsize=None)
def _primary_context(device):
    """The handle of numba's context on GPU ``device`` (the device's primary context)."""
    from numba import cuda

    with cuda.gpus[device]:
        return int(cuda.current_context().handle)


def plan(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), backward=False, device=None,
         deterministic=True, softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None,
         mod_args=(), block_mask=None, return_lse=False, tiles=None):
    """The `tiling.Plan` that `attention` (with ``return_lse``), or with ``backward=True`` `attention_backward` with
    ``deterministic``, would run for these operands and modifications: the same arguments, checked as those calls
    check them (a plan depends on softcap, ALiBi, the user's functions, a block mask and, forward, on whether the
    LSE is taken: `tiling.make_plan`). Pass it to the call as ``plan=``.

    ``device`` (a `tiling.Device`) plans for another GPU than the current one. ``tiles`` (a `tiling.Tiles`,
    `tiling.MmaTiles` or `tiling.WgmmaTiles`) replaces the planned blocks, the rest of the plan made for this call:
    the ladder of kernel versions and their tilings, one call at a time (`tiling` says which each plan takes and
    why).
    """
    if device is not None and not isinstance(device, tiling.Device):
        raise TypeError(f"device must be None (the current GPU) or a numbaflash.tiling.Device; got {type(device).__name__}")
    if tiles is not None and not isinstance(tiles, (tiling.Tiles, tiling.MmaTiles, tiling.WgmmaTiles)):
        raise TypeError(f"tiles must be None (the planned blocks) or a numbaflash.tiling.Tiles, MmaTiles or WgmmaTiles; "
                        f"got {type(tiles).__name__}")
    return _planned_call(q, k, v, causal, softmax_scale, window_size, backward, deterministic, return_lse, dict(
        softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
        mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask), device, tiles)[1]


def _planned_call(q, k, v, causal, softmax_scale, window_size, backward, deterministic, return_lse, modifications,
                  device=None, tiles=None):
    """``(call, plan)`` of `plan` and `explain`: their flags and the call checked, and the plan it runs."""
    arguments.flag(backward, "backward")
    arguments.flag(deterministic, "deterministic")
    arguments.flag(return_lse, "return_lse")
    call = inspect(q, k, v, causal, softmax_scale, window_size, modifications=modifications, backward=backward)
    with _device_context(call):
        return call, _plan_for(call, backward, device, deterministic=deterministic, lse=return_lse or backward,
                               tiles=tiles)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, plan=None,
              softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(),
              block_mask=None):
    """Exact softmax attention, computed tile by tile without writing the score matrix to memory.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, or ``(seqlen_q, headdim)`` for a single head.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)`` (or ``(seqlen_k, headdim)``); nheads must be a
            multiple of nheads_kv (GQA/MQA): query head h reads key/value head ``h // (nheads // nheads_kv)``.
            Any strides are read in place (q, k, v sliced from a packed qkv tensor need no copy).
            float16, bfloat16, float32 or float64, all the same; headdim from 1 to 256.
        causal: bottom-right aligned causal mask (flash-attn >= 2.1 semantics, see `numbaflash.reference`).
        softmax_scale: scale of QK^T before the softmax, any finite float whose product with log2(e) float32
            holds (float64 for float64 inputs); default ``1 / sqrt(headdim)``.
        window_size: ``(left, right)`` sliding window, -1 for unbounded; causal sets right = 0.
        return_lse: also return the log-sum-exp of each row.
        plan: a `plan(...)` for this call, to choose the kernel's blocks explicitly.
        softcap: scores become ``softcap * tanh(score / softcap)`` after scaling; 0 (the default) is off;
            else at least float32's smallest normal and softmax_scale / float32's largest, at most float32's
            largest over log2(e) (float64's for float64 inputs).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds ``-slope * |i + seqlen_k - seqlen_q - j|``
            to the score of query i and key j.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx, *mod_args)``, a Python function Numba compiles into
            the kernel, returning the new score (after scaling, softcap and ALiBi).
        score_mod_grad: its derivative by ``score``, same arguments: needed by `attention_backward`.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx, *mod_args)``, True where the key is visible (on top of
            causal and window_size).
        mod_args: arrays (of q's kind and device: integers, bools, float32 or float64) the functions read.
            See `numbaflash.mods` for the order and the limits.
        block_mask: a `numbaflash.block_mask(mask_mod, ...)`: the kernel visits only the key tiles where the
            mask shows a score, and on tiles it does not show whole reads the verdicts the block mask kept
            as bits (it calls no mask_mod).

    Returns:
        out with q's shape and dtype; with ``return_lse``, also lse ``(batch, nheads, seqlen_q)`` (``(seqlen_q,)``
        for a 2-D call), float32 (float64 for float64 inputs). A row that sees no key gets out = 0 and
        lse = -inf. Outputs are arrays of q's library (CuPy, torch, NumPy on the simulator) on q's
        device, computed on that library's current stream.
    """
    arguments.flag(return_lse, "return_lse")
    call = inspect(q, k, v, causal, softmax_scale, window_size, modifications=dict(
        softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
        mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask))
    with _device_context(call):
        plan = (_check_plan(plan, call, "forward", lse=return_lse) if plan is not None
                else _plan_for(call, backward=False, lse=return_lse))
        out = _arrays.output(call.q, (call.batch, call.seqlen_q, call.nheads, call.headdim), call.dtype, "out")
        lse = _arrays.output(call.q, (call.batch, call.nheads, call.seqlen_q), call.lse_dtype, "lse")
        run_forward(call, plan, out, lse)
    out, lse = out.obj, lse.obj
    if call.single_head:
        out, lse = out[0, :, 0, :], lse[0, 0, :]
    return (out, lse) if return_lse else out


def _scale_arg(call):
    """softmax_scale * log2(e) in the accumulator type: the kernels work in base 2; softmax_scale itself for
    modified scores, which the modifications take in natural units (`kernels.mods`)."""
    scale = call.softmax_scale if call.mods.scores_modified else call.softmax_scale * LOG2E
    return _accumulator_scalar(call)(scale)


BUILDERS = {
    "wgmma_forward": wgmma_forward.build,
    "wgmma_ws_forward": wgmma_ws_forward.build,
    "wgmma_tma_forward": wgmma_ws_forward.build,
    "mma_forward": mma_forward.build,
    "simt_forward": simt_forward.build,
    "simt_backward_preprocess": simt_backward.build_preprocess,
    "wgmma_tma_backward_preprocess": simt_backward.build_staged_preprocess,
    "simt_backward_dkdv": simt_backward.build_dkdv,
    "simt_backward_dq": simt_backward.build_dq,
    "mma_backward_dkdv": mma_backward.build_dkdv,
    "mma_backward_dq": mma_backward.build_dq,
    "wgmma_backward_dkdv": wgmma_backward.build_dkdv,
    "wgmma_backward_dq": wgmma_backward.build_dq,
    "wgmma_tma_backward_dkdv": wgmma_ws_backward.build_dkdv,
    "wgmma_tma_backward_dq": wgmma_ws_backward.build_dq,
    "wgmma_tma_backward_dkdvdq": wgmma_ws_backward.build_dkdv_dq,
    "backward_dq_postprocess": simt_backward.build_dq_postprocess,
}


def kernel_for(plan, launch, modified=NONE):
    """The `compiled.Kernel` that runs ``launch``, one of ``plan.launches``, with the modifications ``modified``."""
    return compiled.kernel(BUILDERS[launch.kernel], plan.headdim_padded, plan.tiles, plan.dtype, launch.threads,
                           modified)


def _launch(plan, index, stream, modified, *args, grid=None, layout=None):
    """Launch ``plan.launches[index]`` (on ``grid`` instead of its own, if given); ``layout``: a dict kept for
    this layout of the arguments (`compiled.Kernel.launch`), or None."""
    launch = plan.launches[index]
    # The plan keeps its kernels: compiled.kernel's cache hashes the tiles and the modifications on every
    # lookup, 3.9 microseconds of a forward's host time (H100 host, .bench/hostseg.py).
    kernel = plan.kernels.get((index, modified))
    if kernel is None:
        kernel = plan.kernels[index, modified] = kernel_for(plan, launch, modified)
    try:
        kernel.launch(grid or launch.grid, launch.threads, launch.smem_bytes, stream, *args, layout=layout)
    except NumbaError as error:
        if not modified.user_functions:
            raise
        raise TypeError(f"{launch.kernel} did not compile with {modified.describe()}: "
                        + " ".join(str(error).split())[:800]) from None


def vector_staging(plan, *operands):
    """Whether the kernels can stage these operands' tiles in vectors (one flag per launch).

    The head dimension must be contiguous, a multiple of `tiling.vector_elements`, and aligned. Otherwise
    tiles are staged element by element, and `explain` says so.
    """
    return all(op.vector_aligned(tiling.vector_elements(plan.tiles)) for op in operands)


def _scalars(call, plan, *operands):
    """The kernels' scalar arguments after the operands, (scale, left, right, vector staging of ``operands``),
    once the staging is found to suit ``plan``'s copies."""
    vec = vector_staging(plan, *operands)
    tiling.check_copy_engine(plan.tiles, vec)
    return _scale_arg(call), call.left, call.right, vec


def run_forward(call, plan, out, lse):
    """Launch the forward kernel of ``plan`` on validated operands (``out``, ``lse`` preallocated)."""
    scalars = call.remembered(("scalars", plan.tiles), lambda: _scalars(call, plan, call.q, call.k, call.v))
    args = [call.q, call.k, call.v, out, lse, *scalars]
    if isinstance(plan.tiles, tiling.WgmmaTiles) and plan.tiles.producer:
        args.append(wgmma_ws_forward.tensor_map_args(call.q, call.k, call.v, plan.tiles))
    mod_values = call.mod_values
    if call.mods.block_sparse:
        mod_values = (call.block_mask.key_tiles(plan.block_m, plan.block_n, call.left, call.right, call.q),) + mod_values
    layout = call.remembered("launches", dict)  # the launch's packed values, for the next call of this layout
    _launch(plan, 0, _arrays.stream_of(call.q), call.mods, *args, mod_values, layout=layout)


_PACKED = Mods(packed=True)  # the staged preprocess of a varlen call: its sequences are all it needs to know


def run_backward(call, plan, dout, lse, out, delta, dq, dk, dv, preprocess=None):
    """Launch the three backward kernels of ``plan`` on one stream; ``delta`` is the O(N) workspace
    (`tiling.Plan.delta_shape`: D, or the staged LSE and D that v5's producers copy in bulk).

    ``preprocess``: ``(out, dout, delta, grid)`` for the first launch (delta = rowsum(dO * O), row by row)
    where it reads other views than the others: a varlen call's packed rows as one batch element. A varlen
    call's staged statistics (v5) are `tiling.packed_delta_shape`, which its preprocess fills sequence by
    sequence, given the cu_seqlens."""
    stream = _arrays.stream_of(call.q)
    q, k, v = call.q, call.k, call.v
    # The caller's dout, out and lse have q's shapes but strides and alignment of their own: what depends on
    # them is kept per layout of those too.
    extra = call.remembered(("scalars", plan.tiles, dout.strides, dout.ptr % 16),
                            lambda: _scalars(call, plan, q, k, v, dout))
    layout = call.remembered(("launches", dout.strides, dout.ptr % 16, out.strides, lse.strides), dict)
    if preprocess is not None:
        _launch(plan, 0, stream, NONE, *preprocess[:3], grid=preprocess[3])
    elif call.mods.packed:  # v5's staged preprocess of packed sequences, which locates each one's rows
        _launch(plan, 0, stream, _PACKED, out, dout, lse, delta, call.mod_values[:2], layout=layout)
    else:
        _launch(plan, 0, stream, NONE, out, dout, *((lse,) if plan.staged_statistics else ()), delta, layout=layout)
    maps = ((), ())
    if isinstance(plan.tiles, tiling.WgmmaTiles) and plan.tiles.producer:
        maps = tuple((m,) for m in wgmma_ws_backward.tensor_map_args(q, k, v, dout, plan.tiles))
    # Both passes own block_m rows (keys, then queries) and stream block_n; with a block mask each gets the
    # list of tiles it visits, first in its mod tuple.
    key_pass_mods = dq_pass_mods = call.mod_values
    if call.mods.block_sparse:
        key_pass_mods = (call.block_mask.query_tiles(plan.block_m, plan.block_n, call.left, call.right,
                                                     call.nheads // call.nheads_kv, q),) + call.mod_values
        dq_pass_mods = (call.block_mask.key_tiles(plan.block_m, plan.block_n, call.left, call.right, q),
                        ) + call.mod_values
    if plan.dq_strategy == "atomic":
        dq_acc = _arrays.describe(_arrays.zeros(q, plan.dq_acc_shape, "float32"), "dq_acc")
        _launch(plan, 1, stream, call.mods, q, k, v, dout, lse, delta, dk, dv, dq_acc, *extra, *maps[0],
                key_pass_mods, layout=layout)
        _launch(plan, 2, stream, NONE, dq_acc, dq, np.float32(call.softmax_scale), layout=layout)
        return
    _launch(plan, 1, stream, call.mods, q, k, v, dout, lse, delta, dk, dv, *extra, *maps[0], key_pass_mods,
            layout=layout)
    _launch(plan, 2, stream, call.mods, q, k, v, dout, lse, delta, dq, *extra, *maps[1], dq_pass_mods, layout=layout)


def check_array(op, name, must, shape, dtype, call, shapes=None):
    """ValueError unless ``op`` has ``shape`` and ``dtype`` and is of q's library on q's device (a backward's
    dout, out and lse): "``name`` must ``must``: ...". ``shapes``: (wanted, op's) as the caller passed them (a 2-D
    call's operands are compared as (1, seqlen, 1, headdim) views)."""
    if op.shape != shape or op.dtype != dtype or op.kind != call.q.kind or op.device != call.device:
        wanted, got = shapes or (shape, op.shape)
        raise ValueError(f"{name} must {must}: shape {wanted}, dtype {dtype} on q's device; got shape {got}, "
                         f"dtype {op.dtype}")


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       plan=None, softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None,
                       mod_args=(), block_mask=None, deterministic=True):
    """Gradients of `attention` by recomputation from the saved log-sum-exp.

    Args:
        dout: gradient of the output, shaped like ``out``.
        q, k, v, causal, softmax_scale, window_size: as passed to `attention`.
        out, lse: `attention`'s outputs (``return_lse=True``).
        plan: a ``plan(..., backward=True)`` for this call.
        softcap, alibi_slopes, score_mod, score_mod_grad, mask_mod, mod_args, block_mask: as passed to
            `attention`; with a ``score_mod``, ``score_mod_grad`` is required. With a block mask both passes
            visit only its non-empty tiles; on the partial ones they read the verdicts the block mask kept as
            bits (tensor-core kernels; the dK/dV pass's transposed) or call its mask_mod (CUDA cores).
        deterministic: True (the default): no atomics, repeated calls return bitwise identical gradients.
            False (flash-attn's meaning) allows a backward whose dQ sums in a varying order: with v5's tiles
            asked for (``plan=``), the wgmma backward then forms dQ in its dK/dV kernel and adds it with
            float32 atomics, which saves recomputing S and dP; a planned call runs it with softcap (alone or
            with ALiBi) at head dims up to 64, where it forms each score's tanh and ex2 once instead of twice,
            and the two deterministic passes elsewhere, which are faster there (`explain(..., backward=True,
            deterministic=False)` says which runs).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v. For GQA, dk and dv sum over the query
        heads of each group. Extra memory: one float32 (float64 for float64) value per query row and head (two
        per row padded to whole tiles on Hopper's v5 kernels), and with atomics a float32 dQ (headdim padded to
        64 or 128, rows to 64).
    """
    call = inspect(q, k, v, causal, softmax_scale, window_size, modifications=dict(
        softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, score_mod_grad=score_mod_grad,
        mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask), backward=True)
    ops = [_arrays.describe(x, n) for x, n in ((dout, "dout"), (out, "out"))]  # TypeError for a non-array
    lse_op = _arrays.describe(lse, "lse")
    shown = [op.shape for op in (*ops, lse_op)]  # as the caller passed them, for the messages
    if call.single_head:
        for op, name, ndim in zip((*ops, lse_op), ("dout", "out", "lse"), (2, 2, 1)):
            if len(op.shape) != ndim:
                raise ValueError(f"{name} must be {ndim}-D in a 2-D (seqlen, headdim) call, as attention returns it; "
                                 f"got shape {op.shape}")
        ops = [_arrays.single_head_view(op, n) for op, n in zip(ops, ("dout", "out"))]
        lse_op = _arrays.describe(lse[None, None, :], "lse")
    q_shown = call.q.shape[1::2] if call.single_head else call.q.shape
    for op, name, got in zip(ops, ("dout", "out"), shown):
        check_array(op, name, "match q", call.q.shape, call.dtype, call, (q_shown, got))
    want_lse = (call.batch, call.nheads, call.seqlen_q)
    check_array(lse_op, "lse", "be attention's log-sum-exp", want_lse, call.lse_dtype, call,
                (want_lse[2:] if call.single_head else want_lse, shown[2]))
    with _device_context(call):
        arguments.flag(deterministic, "deterministic")
        plan = (_check_plan(plan, call, "backward") if plan is not None else
                _plan_for(call, True, dout=ops[0], deterministic=deterministic))
        if deterministic and plan.dq_strategy == "atomic":
            raise ValueError("plan accumulates dQ with atomics (made with deterministic=False); pass "
                             "deterministic=False with it, or a deterministic plan")
        grads = [_arrays.output(call.q, x.shape, call.dtype, n)
                 for x, n in ((call.q, "dq"), (call.k, "dk"), (call.v, "dv"))]
        delta = _arrays.output(call.q, plan.delta_shape, call.lse_dtype, "delta")
        run_backward(call, plan, ops[0], lse_op, ops[1], delta, *grads)
    dq, dk, dv = (g.obj for g in grads)
    if call.single_head:
        return dq[0, :, 0, :], dk[0, :, 0, :], dv[0, :, 0, :]
    return dq, dk, dv


def _mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def _compared(standard, flash):
    """How standard attention's traffic compares with the plan's: "3.2x more", or "1.1x less" (tiny problems)."""
    ratio = standard["total"] / flash["total"]
    return f"{ratio:.1f}x more" if ratio >= 1 else f"{1 / ratio:.1f}x less"


def explain(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), backward=False, softcap=0.0,
            alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None,
            deterministic=True, return_lse=False):
    """Which kernel runs for this call and why, its plan, and its HBM traffic as `sim` predicts it
    (``deterministic``: as given to `attention_backward`; ``return_lse``: as given to `attention`)."""
    import sim

    call, the_plan = _planned_call(q, k, v, causal, softmax_scale, window_size, backward, deterministic, return_lse,
                                   dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                                        score_mod_grad=score_mod_grad, mask_mod=mask_mod, mod_args=mod_args,
                                        block_mask=block_mask))
    sizes = dict(seqlen_k=call.seqlen_k, batch=call.batch, nheads=call.nheads, nheads_kv=call.nheads_kv,
                 causal=causal, window_size=tuple(window_size), backward=backward, dtype_bytes=the_plan.dtype_bytes)
    flash = sim.predict_io(call.seqlen_q, call.headdim, plan=the_plan, block_mask=call.block_mask, **sizes)
    standard = sim.predict_io(call.seqlen_q, call.headdim, algorithm="standard", sram_bytes=the_plan.sram_bytes, **sizes)
    mask = "causal" if causal else (f"window {tuple(window_size)}" if tuple(window_size) != (-1, -1) else "no mask")
    heads = f"{call.nheads}" + (f" (GQA, {call.nheads_kv} kv heads)" if call.nheads_kv != call.nheads else "")
    staging = ("tiles staged in vectors" if vector_staging(the_plan, call.q, call.k, call.v) else
               "tiles staged element by element, slower: the head dimension is not contiguous, not a multiple of "
               f"{tiling.vector_elements(the_plan.tiles)}, or not 16-byte aligned")
    return "\n".join([
        f"numbaflash.{'attention_backward' if backward else 'attention'}: batch {call.batch}, seqlen_q {call.seqlen_q}, "
        f"seqlen_k {call.seqlen_k}, heads {heads}, headdim {call.headdim}, {call.dtype}, {mask}",
        the_plan.describe(),
        f"staging     {staging}",
        f"modified    {_modifications_line(call.mods)}",
        *_block_mask_lines(call, the_plan, backward),
        f"HBM traffic (sim closed form for this plan): {_mib(flash['total_bytes'])} "
        f"(reads {flash['reads']:,}, writes {flash['writes']:,} elements)",
        f"standard attention (S and P through HBM):   {_mib(standard['total_bytes'])}, {_compared(standard, flash)}",
        *_on_the_gpu(call, the_plan, causal, window_size),
    ])


def _modifications_line(modified):
    if not modified.active:
        return "none (no softcap, ALiBi, score_mod or mask_mod)"
    how = ["scores modified in natural-log units" if modified.scores_modified else "scores keep the plain scale"]
    if modified.mask_mod is not None:
        how.append("mask_mod's verdicts, read from the block mask's bits, on every tile it does not find full"
                   if modified.block_sparse else "mask_mod's verdicts on every tile the causal/window mask shows")
    # What the kernels read beside the operands (and a block mask's table and bits, which the GPU line counts).
    reads = [name for name, read in (("slopes", modified.alibi), ("mod_args", modified.per_score_functions)) if read]
    left_out = (f" (the traffic below leaves out the {' and '.join(reads)} the kernels read, which the caches serve)"
                if reads else "")
    cached = ""
    if modified.user_functions:
        _, unkeyable = function_keys.mods_key(modified)
        cached = ("; on a GPU these kernels are kept in the disk cache, keyed by the functions' code and the values "
                  "they read" if unkeyable is None else
                  f"; these kernels compile once per process, never from the disk cache: {unkeyable}")
    return f"{modified.describe()}, compiled into the kernels: {'; '.join(how)}{left_out}{cached}"


def _block_mask_lines(call, the_plan, backward):
    if call.block_mask is None:
        return []
    bm, bn = the_plan.block_m, the_plan.block_n
    if not backward:
        tiles = f"{call.block_mask.density(bm, bn):.1%} of the {bm} x {bn} tiles are not empty: the forward visits"
    else:  # both passes own block_m rows (keys, then queries) and stream block_n
        tiles = f"{call.block_mask.density(bn, bm):.1%} of the {bn}-query x {bm}-key tiles of the dK/dV pass"
        if the_plan.dq_strategy != "atomic":
            tiles += f" and {call.block_mask.density(bm, bn):.1%} of the {bm} x {bn} tiles of the dQ pass"
        tiles += " are not empty: the backward visits"
    # Every family reads bits (a dK/dV pass its transposed ones) and asks the mask_mod nothing.
    partial = "on the partial ones reads the block mask's verdicts (kept as bits when it made its tiles)"
    from sim.hardware import schedules

    counted = ("the HBM traffic below counts only those, and the GPU line the kernels' reads of the block mask's "
               "table and bits as well" if schedules.family(the_plan.tiles) else
               "the HBM traffic and the GPU line below count only those; the GPU line leaves out the kernels' reads of "
               "the block mask's table")
    return [f"block mask  {tiles} only those, and {partial} ({counted})"]


EXPLAIN_TILE_VISITS = 500_000  # about 5 s of `sim.hardware.predict`: explain skips (and says so) past this


def _on_the_gpu(call, the_plan, causal, window_size):
    """What `sim.hardware` predicts this call moves on the GPU, and where it sits on the roofline."""
    from sim import hardware

    gpu = hardware.Gpu.current()
    where = f"{gpu.name}, modelled: the CUDA simulator has no GPU" if SIMULATOR else gpu.name
    visits = hardware.tile_visits(the_plan)
    if visits > EXPLAIN_TILE_VISITS:
        return [f"on the GPU  not modelled here: about {visits:,} tile visits, past explain's {EXPLAIN_TILE_VISITS:,} "
                f"(some {visits // 100_000} s); sim.hardware.predict(numbaflash.plan(...)) runs it"]
    operands = {name: hardware.Operand.of(op.obj) for name, op in (("q", call.q), ("k", call.k), ("v", call.v))}
    if call.single_head:
        operands = None  # the kernels see 4-D views of 2-D arrays; their layout is the contiguous one
    pred = hardware.predict(the_plan, causal=causal, window_size=window_size, operands=operands, gpu=gpu,
                            block_mask=call.block_mask)
    reductions = f", reductions {_mib(pred.total('reduce_bytes'))}" if pred.total("reduce_bytes") else ""
    lines = [f"on the GPU  sim.hardware ({where}): global memory {_mib(pred.global_bytes)} requested in 32-byte sectors "
             f"(loads {_mib(pred.total('load_bytes'))}, asynchronous copies {_mib(pred.total('async_bytes'))}, stores "
             f"{_mib(pred.total('store_bytes'))}{reductions}); DRAM {_mib(pred.dram_bytes)} after the L2 model (reads "
             f"{_mib(pred.total('dram_read_bytes'))}, writes {_mib(pred.total('dram_write_bytes'))})"]
    bound = pred.bound()
    intensity = f"intensity   {pred.intensity:,.0f} FLOP per DRAM byte ({pred.flops / 1e9:,.1f} GFLOP)"
    if bound is None:
        lines.append(intensity + f"; no peak figures for {gpu.name}, so no roofline verdict")
    else:
        bandwidth, peaks = gpu.peaks
        lines.append(intensity + f"; the ridge point is {bound[1]:,.0f} ({pred.compute} peak {peaks[pred.compute] / 1e12:,.0f} "
                     f"TFLOP/s over {bandwidth / 1e12:.2f} TB/s): {bound[0]}-bound")
    return lines
