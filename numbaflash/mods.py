"""Score and mask modifications: flash-attn's softcap and ALiBi, and the user's own Python functions.

What a call asks for becomes a `Mods` (which modifications, compiled into the kernels: part of every
kernel's specialization) and the values the kernels read at run time (``mod_values``: the softcap, the
slopes, the user's ``mod_args``). The reference applies the same modifications on the host
(`modify`, `visible`), so kernels and reference agree by construction, as `masks` makes them agree
on causal and windows.

The order, as in flash-attn and FlexAttention, on the score ``x = softmax_scale * q . k`` of query row
``q_idx`` and key ``kv_idx``:

1. ``softcap > 0``: ``x = softcap * tanh(x / softcap)``;
2. ``alibi_slopes``: ``x -= slope[b, h] * |q_idx + seqlen_k - seqlen_q - kv_idx|`` (bottom-right aligned);
3. ``score_mod``: ``x = score_mod(x, b, h, q_idx, kv_idx, *mod_args)``;

and a key is visible where the causal/window mask and ``mask_mod(b, h, q_idx, kv_idx, *mod_args)``
both allow it. The backward needs d(modified score)/d(score): softcap's is ``1 - tanh^2``, ALiBi's 1, and
``score_mod``'s comes from ``score_mod_grad(x, b, h, q_idx, kv_idx, *mod_args)``, which the user writes
(the derivative with respect to ``x`` at the score ``score_mod`` received). Numba compiles plain
functions of floats and integers; an automatic derivative (dual numbers, complex steps) would need the
user's code to run on types Numba's CUDA target does not give it, so the derivative is the user's.
"""

import dataclasses
import functools
import inspect
import math
import numbers
import types as pytypes
from dataclasses import dataclass

import numpy as np

SCORE_INDEX_ARGS = 4  # b, h, q_idx, kv_idx
ARG_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
              "float64")  # what mod_args may hold: Numba's CUDA target has no float16 or bfloat16 arrays to index


@dataclass(frozen=True)
class Mods:
    """The modifications compiled into a kernel (functions compare by identity); the empty `Mods()` is none.

    ``arg_types``: ``(dtype name, ndim)`` of each of the user's ``mod_args``.
    """

    softcap: bool = False
    alibi: bool = False
    score_mod: object = None
    score_mod_grad: object = None
    mask_mod: object = None
    arg_types: tuple = ()
    block_sparse: bool = False  # a call with a `block_sparsity.BlockMask`: the kernels visit only its non-empty tiles
    packed: bool = False  # a varlen call: sequences packed along one axis, located by cu_seqlens (`kernels.sequences`)

    @property
    def active(self):
        return self.softcap or self.alibi or self.score_mod is not None or self.mask_mod is not None

    @property
    def scores_modified(self):
        """Whether scores change (softcap, ALiBi, score_mod); a mask_mod alone leaves visible scores as they are."""
        return self.softcap or self.alibi or self.score_mod is not None

    @property
    def per_score_functions(self):
        """Whether a forward calls the user's functions per score: a score_mod, or a mask_mod whose verdicts no
        block mask keeps as bits. Their registers do not fit three consumer warpgroups (`tiling`)."""
        return self.score_mod is not None or (self.mask_mod is not None and not self.block_sparse)

    @property
    def softcap_alone(self):
        """softcap without ALiBi or a score_mod: the forwards keep its scores as ``tanh(x / softcap)`` and fold the
        cap into the softmax's scale (`kernels.softmax`), the backwards into the exponent's FFMA with the LSE
        (`kernels.mods`' ``logit2``), and at headdim 64 tanh and ex2 per score bound the special-function unit
        (`tiling.WGMMA_SOFTCAP_TILES`)."""
        return self.softcap and not self.alibi and self.score_mod is None

    @property
    def alibi_alone(self):
        """ALiBi without softcap or a score_mod: on a tile wholly on one side of a warp's diagonal the kernels form
        each score's bias from a row term and a column term (`kernels.mods.alibi_side`); v5's forward at headdim 64
        takes the column term from the tensor cores (`kernels.wgmma.alibi_columns`)."""
        return self.alibi and not self.softcap and self.score_mod is None

    @property
    def user_functions(self):
        """The user's functions (score_mod, its grad, mask_mod): the disk cache keys their kernels by what Numba
        compiles of them (`kernels.function_keys`)."""
        return tuple(f for f in (self.score_mod, self.score_mod_grad, self.mask_mod) if f is not None)

    def __hash__(self):
        # Hashed on every launch (`tiling.Plan.kernels`): worked out once.
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))
        return self.__dict__["_hash"]

    def describe(self):
        parts = (["softcap"] if self.softcap else []) + (["ALiBi"] if self.alibi else [])
        parts += [f"{name} {_name(f)}" for name, f in (("score_mod", self.score_mod), ("mask_mod", self.mask_mod))
                  if f is not None]
        parts += ["block mask"] if self.block_sparse else []
        return ", ".join(parts) if parts else "none"


NONE = Mods()


def _name(fn):
    code = fn.__code__
    return f"{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno})"


def _check_function(fn, name, index_args, n_args):
    if fn is None:
        return None
    if not isinstance(fn, pytypes.FunctionType):
        raise TypeError(f"{name} must be None or a plain Python function (def or lambda) that Numba can compile; "
                        f"got {type(fn).__module__}.{type(fn).__name__}")
    wanted = index_args + n_args
    try:
        inspect.signature(fn).bind(*range(wanted))
    except TypeError:
        raise ValueError(f"{name} {_name(fn)} must take {wanted} positional arguments ({_ARG_NAMES[name]} and the "
                         f"{n_args} mod_args); its signature is {inspect.signature(fn)}") from None
    return fn


_ARG_NAMES = {"score_mod": "score, b, h, q_idx, kv_idx", "score_mod_grad": "score, b, h, q_idx, kv_idx",
              "mask_mod": "b, h, q_idx, kv_idx"}


def check(softcap, alibi_slopes, score_mod, score_mod_grad, mask_mod, mod_args, describe, batch, nheads,
          backward=False):
    """Validate the modification arguments of a call; ``describe(x, name)`` reads an array (`_arrays.describe`).

    Returns ``(Mods, softcap value, slopes Operand or None, mod_args Operands)``.
    """
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number (0.0 turns it off); got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0.0 turns it off); got {softcap!r}")
    slopes = None
    if alibi_slopes is not None:
        slopes = describe(alibi_slopes, "alibi_slopes")
        if slopes.dtype != "float32" or slopes.shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must be float32 of shape (nheads,) = ({nheads},) or (batch, nheads) = "
                             f"({batch}, {nheads}); got {slopes.dtype} of shape {slopes.shape}")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got {type(mod_args).__name__}")
    args = []
    for i, x in enumerate(mod_args):
        op = describe(x, f"mod_args[{i}]")
        if op.dtype not in ARG_DTYPES:
            raise TypeError(f"mod_args[{i}] must be an array of integers, bools, float32 or float64; got {op.dtype}")
        if len(op.shape) == 0:
            raise ValueError(f"mod_args[{i}] must have at least one dimension; got a 0-d array")
        args.append(op)
    n = len(args)
    score_mod = _check_function(score_mod, "score_mod", SCORE_INDEX_ARGS + 1, n)
    score_mod_grad = _check_function(score_mod_grad, "score_mod_grad", SCORE_INDEX_ARGS + 1, n)
    mask_mod = _check_function(mask_mod, "mask_mod", SCORE_INDEX_ARGS, n)
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad was given without score_mod: it is score_mod's derivative")
    if backward and score_mod is not None and score_mod_grad is None:
        raise ValueError(f"the backward through score_mod {_name(score_mod)} needs score_mod_grad(score, b, h, q_idx, "
                         "kv_idx, *mod_args): d score_mod / d score (numbaflash does not differentiate Python)")
    if args and score_mod is None and mask_mod is None:
        raise ValueError("mod_args were given, but no score_mod or mask_mod reads them")
    arg_types = tuple((op.dtype, len(op.shape)) for op in args)
    mods = Mods(softcap > 0, slopes is not None, score_mod, score_mod_grad, mask_mod, arg_types)
    for fn, name, returns in ((score_mod, "score_mod", "a number"), (score_mod_grad, "score_mod_grad", "a number"),
                              (mask_mod, "mask_mod", "a bool")):
        if fn is not None:
            compile_check(fn, name, returns, arg_types)
    return mods, float(softcap), slopes, tuple(args)


@functools.lru_cache(maxsize=None)
def compile_check(fn, name, returns, arg_types):
    """Compile ``fn`` with Numba for the kernels' argument types (on the CPU: the same typing as the CUDA
    target's for plain arithmetic); TypeError naming the function, its line and Numba's complaint.

    A pass is remembered in the disk cache under the function's digest (`kernels.function_keys`): the first
    CPU compile of a process costs about a second, most of a new process's first call once its kernels are
    on disk."""
    import numba
    from numba import types
    from numba.core.errors import NumbaError

    from .kernels import disk_cache, function_keys

    fn_digest = function_keys.digest_or_none(fn)
    passed = None if fn_digest is None else disk_cache.key(("compile_check", fn_digest, name, returns, arg_types,
                                                            numba.__version__))
    if passed is not None and disk_cache.remembered(passed):
        return

    arrays = tuple(types.Array(numba.from_dtype(np.dtype(d)), ndim, "A") for d, ndim in arg_types)
    index = (types.int64,) * SCORE_INDEX_ARGS
    signature = ((types.float32,) if name != "mask_mod" else ()) + index + arrays
    dispatcher = numba.njit(fn)
    try:
        dispatcher.compile(signature)
    except NumbaError as error:
        detail = str(error).strip().splitlines()
        raise TypeError(f"{name} {_name(fn)} cannot be compiled by Numba for ({', '.join(map(str, signature))}): "
                        + " ".join(line.strip() for line in detail if line.strip())[:800]) from None
    got = dispatcher.overloads[signature].signature.return_type
    ok = isinstance(got, types.Boolean) if returns == "a bool" else isinstance(got, (types.Float, types.Integer))
    if not ok:
        raise TypeError(f"{name} {_name(fn)} must return {returns}; Numba types its result as {got}")
    if passed is not None:
        disk_cache.remember(passed)


# -- the same modifications on the host, for the reference (NumPy arrays of (batch, nheads, seqlen_q, seqlen_k))

@functools.lru_cache(maxsize=None)
def _host_loop(fn, takes_score):
    """A Numba loop calling ``fn`` on every (b, h, i, j) of a 4-D array."""
    import numba

    f = numba.njit(fn)
    if takes_score:
        @numba.njit
        def element(score, b, h, i, j, args):
            return f(score, b, h, i, j, *args)
    else:
        @numba.njit
        def element(score, b, h, i, j, args):
            return f(b, h, i, j, *args)

    @numba.njit
    def loop(s, out, args):
        for b in range(s.shape[0]):
            for h in range(s.shape[1]):
                for i in range(s.shape[2]):
                    for j in range(s.shape[3]):
                        out[b, h, i, j] = element(s[b, h, i, j], b, h, i, j, args)

    return loop


def _user(fn, s, args, takes_score=True, out_dtype=np.float64):
    """``fn`` on every element, in float64 (the user's function runs in float64 on the host; np.longdouble
    scores pass through float64 there)."""
    out = np.empty(s.shape, dtype=out_dtype)
    _host_loop(fn, takes_score)(np.asarray(s, dtype=np.float64), out, tuple(np.asarray(a) for a in args))
    return out


def alibi_distance(seqlen_q, seqlen_k):
    """``|i + seqlen_k - seqlen_q - j|`` for every (i, j): ALiBi's distance, aligned bottom-right like the masks."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return np.abs(i + seqlen_k - seqlen_q - j)


def modify(s, softcap=0.0, alibi_slopes=None, score_mod=None, score_mod_grad=None, mod_args=()):
    """``(modified, d modified / d s)`` of scaled scores ``s`` (batch, nheads, seqlen_q, seqlen_k), in ``s``'s
    precision (the user's functions in float64); the derivative is None for a score_mod without its grad."""
    ds = np.ones_like(s)
    if softcap:
        with np.errstate(over="ignore"):  # a softcap near the smallest normal number: s / softcap is +-inf, tanh +-1
            t = np.tanh(s / softcap)
        s, ds = softcap * t, 1 - t * t
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=s.dtype)
        slopes = slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]
        s = s - slopes * alibi_distance(s.shape[2], s.shape[3])
    if score_mod is not None:
        ds = None if score_mod_grad is None else ds * _user(score_mod_grad, s, mod_args).astype(s.dtype)
        s = _user(score_mod, s, mod_args).astype(s.dtype)
    return s, ds


def visible(mask_mod, shape, mod_args=()):
    """``mask_mod`` on every (b, h, q_idx, kv_idx) of ``shape``: a boolean array, all True without one."""
    if mask_mod is None:
        return np.ones(shape, dtype=bool)
    return _user(mask_mod, np.empty(shape), mod_args, takes_score=False, out_dtype=np.bool_)
