"""Disk-cache keys for the user's functions: a digest of everything Numba compiles of a score_mod or mask_mod.

Numba compiles a function from its bytecode and freezes, at compile time, every global and closure variable it
reads (numbers, tuples and arrays become constants; functions and device functions are compiled in). So the
digest covers the bytecode and constants of the function and of every function nested in it, its defaults, and the
value of each global or closure name its code mentions, followed into the functions, device functions and modules
those hold. Line numbers and file names are left out (a cubin does not depend on them), so editing a file around a
function keeps its kernels.

A value the digest cannot see into (a class of the user's, such as an IntEnum, or any other object) raises `Unkeyable`
naming it, and the kernels of such a call are compiled once per process, as before disk keys existed: a stale
kernel from the disk would be a silently wrong answer, a compile only a slow one. Modules of the libraries
whose functions Numba compiles itself (``math``, ``cmath``, ``numpy``, ``numba``, ``operator``) are keyed by name;
any other module by the attributes the code names.
"""

import builtins
import hashlib
import sys
import types as pytypes

import numpy as np

_LIBRARIES = {"math", "cmath", "numpy", "numba", "numba_cuda", "operator"}


class Unkeyable(Exception):
    """A function reads a value the digest cannot see into; the message names it."""


def digest(fn):
    """SHA-256 (hex) of what Numba compiles of ``fn``; `Unkeyable` where that cannot be told from its values."""
    parts = _Digest().function(fn, fn.__qualname__)
    return hashlib.sha256(repr((sys.implementation.cache_tag, parts)).encode()).hexdigest()


def digest_or_none(fn):
    """`digest`, or None where ``fn`` is `Unkeyable` (what depends on it is then never kept on disk)."""
    try:
        return digest(fn)
    except Unkeyable:
        return None


def array_key(v):
    """A NumPy array's key: its dtype, shape and the SHA-256 of its values in C order (not its strides: equal values
    index alike, and a unit axis's stride varies with how the array was made)."""
    return ("ndarray", v.dtype.str, v.shape, hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest())


def mods_key(mods):
    """``(key, None)``: the user's functions of a `numbaflash.mods.Mods` as a tuple for `disk_cache.key`
    (each function's slot and digest), or ``(None, reason)`` where one of them is `Unkeyable`."""
    named = (("score_mod", mods.score_mod), ("score_mod_grad", mods.score_mod_grad), ("mask_mod", mods.mask_mod))
    try:
        return tuple((slot, digest(fn)) for slot, fn in named if fn is not None), None
    except Unkeyable as why:
        return None, str(why)


def _code_names(code):
    """Every global, attribute and free-variable name ``code`` and the code nested in it mention."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            names |= _code_names(const)
    return names


def _code(code):
    """What a code object means to Numba, without its line numbers and file name."""
    consts = tuple(_code(c) if isinstance(c, pytypes.CodeType) else _constant(c) for c in code.co_consts)
    return (code.co_name, code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            getattr(code, "co_exceptiontable", b""))


def _constant(c):
    if isinstance(c, frozenset):  # `x in {1, 2}`: its iteration order follows string hashing, which varies by process
        return ("frozenset", tuple(sorted(repr(_constant(x)) for x in c)))
    if isinstance(c, tuple):
        return tuple(_constant(x) for x in c)
    return (type(c).__name__, repr(c))


class _Digest:
    """One digest's walk: functions and modules met again (recursion) are named by their place in the walk."""

    def __init__(self):
        self._seen = {}

    def function(self, fn, where):
        if id(fn) in self._seen:
            return ("again", self._seen[id(fn)])
        self._seen[id(fn)] = len(self._seen)
        code = fn.__code__
        names = _code_names(code)
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        read = []
        for name in sorted(names):
            if name in cells:
                try:
                    value = cells[name].cell_contents
                except ValueError:  # a cell not yet filled: the function refers to itself before it is bound
                    read.append((name, "empty cell"))
                    continue
                read.append((name, self.value(value, f"{where}'s closure variable {name!r}", names)))
            elif name in fn.__globals__:
                read.append((name, self.value(fn.__globals__[name], f"{where}'s global {name!r}", names)))
            else:  # a builtin, or an attribute name (np.exp's 'exp'): its absence from the globals is what counts
                read.append((name, "builtin" if hasattr(builtins, name) else "absent"))
        defaults = tuple(self.value(d, f"{where}'s default", names) for d in fn.__defaults__ or ())
        kwdefaults = tuple((k, self.value(d, f"{where}'s default {k!r}", names))
                           for k, d in sorted((fn.__kwdefaults__ or {}).items()))
        return ("function", _code(code), tuple(read), defaults, kwdefaults)

    def value(self, v, where, names):
        """The key of a value Numba freezes; ``names``: the names the reading code mentions (a module's
        attributes among them are followed)."""
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return (type(v).__name__, repr(v))
        if isinstance(v, np.generic):
            return ("numpy scalar", v.dtype.str, v.tobytes())
        if isinstance(v, np.ndarray):
            return array_key(v)
        if isinstance(v, tuple):
            fields = getattr(type(v), "_fields", None)
            kind = ("namedtuple", type(v).__qualname__, fields) if fields is not None else ("tuple",)
            return kind + tuple(self.value(x, where, names) for x in v)
        if isinstance(v, pytypes.FunctionType):
            return self.function(v, v.__qualname__)
        if hasattr(v, "py_func") and _top(type(v).__module__) in _LIBRARIES:  # a numba (device) dispatcher
            options = sorted((k, repr(o)) for k, o in getattr(v, "targetoptions", {}).items())
            return ("dispatcher", type(v).__qualname__, tuple(options), self.function(v.py_func, v.py_func.__qualname__))
        if isinstance(v, pytypes.ModuleType):
            if _top(v.__name__) in _LIBRARIES:
                return ("module", v.__name__)
            if id(v) in self._seen:  # modules that import one another
                return ("again", self._seen[id(v)])
            self._seen[id(v)] = len(self._seen)
            attributes = tuple((n, self.value(getattr(v, n), f"{where}.{n}", names)) for n in sorted(names)
                               if hasattr(v, n))
            return ("module", v.__name__, attributes)
        if isinstance(v, (type, pytypes.BuiltinFunctionType)) or _top(type(v).__module__) == "numba":
            # np.float32, math.exp, numba.float32, numpy's ufuncs: the libraries' own, named by where they live
            module = getattr(v, "__module__", None) or type(v).__module__
            if _top(module) in _LIBRARIES or module == "builtins":
                return ("library", module, getattr(v, "__qualname__", None) or repr(v))
        if isinstance(v, np.ufunc):
            return ("ufunc", v.__name__)
        raise Unkeyable(f"{where}, of type {type(v).__module__}.{type(v).__qualname__}, holds what the disk cache's "
                        "key cannot see into")


def _top(module):
    return (module or "").split(".")[0]
