"""Compiled kernels kept on disk, so that a new process loads each kernel instead of compiling it again.

A compile costs about 3 seconds per kernel specialization; Triton and FlashAttention-4 cache theirs, and
so does numbaflash. An entry is the cubin and its entry point's name, stored under a key that covers
everything that changes the machine code: the source of every kernel module (`numbaflash.kernels`, the
mask bounds they share and the block-mask tables they read), the specialization (builder, head dim, tiles, dtype, launch bounds), the
GPU's compute capability, and the numba, numba-cuda, NVVM and driver versions.

The directory is ``$NUMBAFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/numbaflash``, else
``~/.cache/numbaflash``. Entries are written whole or not at all (a temporary file, then a rename); an
entry whose checksum does not match its cubin is deleted and the kernel is compiled again. Beside the
cubins it keeps empty ``.ok`` entries, verdicts that need no content (`remember`), and NumPy arrays (`store_array`:
a block mask's evaluation, `numbaflash.block_sparsity`).
"""

import functools
import hashlib
import io
import json
import os
import tempfile
import zlib

import numpy as np

ENV = "NUMBAFLASH_CACHE_DIR"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def directory():
    configured = os.environ.get(ENV)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numbaflash")


@functools.lru_cache(maxsize=None)
def source_digest():
    """SHA-256 of the sources an entry follows from: every file under ``numbaflash/kernels``, ``numbaflash/masks.py``
    (the mask bounds the kernels share) and ``numbaflash/block_sparsity.py`` (the block-mask tables the kernels read,
    and the evaluations `store_array` keeps)."""
    digest = hashlib.sha256()
    kernels = os.path.join(_PACKAGE, "kernels")
    paths = [os.path.join(root, name) for root, _, names in os.walk(kernels) for name in names if name.endswith(".py")]
    for path in sorted(paths) + [os.path.join(_PACKAGE, name) for name in ("masks.py", "block_sparsity.py")]:
        digest.update(os.path.relpath(path, _PACKAGE).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def key(parts):
    """The entry name of a specialization: ``parts`` (a tuple of reprs) with the sources' digest (`source_digest`)."""
    return hashlib.sha256(repr((source_digest(), parts)).encode()).hexdigest()


def _path(entry, suffix=".cubin"):
    return os.path.join(directory(), entry[:2], entry + suffix)


def load(entry):
    """``(entry_name, cubin)`` of a stored kernel, or None (absent; corrupt entries are deleted)."""
    stored = _read(entry, ".cubin")
    return None if stored is None else (stored[0]["entry_name"], stored[1])


def store(entry, entry_name, cubin):
    """Write a kernel's entry whole (a reader never sees a partial file); a read-only cache is skipped."""
    _write(entry, ".cubin", {"entry_name": entry_name}, cubin)


def load_array(entry):
    """A stored NumPy array (`store_array`), or None (absent; corrupt entries are deleted)."""
    stored = _read(entry, ".npy.z")
    if stored is None:
        return None
    try:
        return np.load(io.BytesIO(zlib.decompress(stored[1])), allow_pickle=False)
    except (ValueError, zlib.error):
        remove(entry, ".npy.z")
        return None


def store_array(entry, array):
    """Keep ``array`` under ``entry`` (``.npy`` bytes, compressed by zlib's fastest level: a block mask's counts
    are mostly runs of equal values)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    _write(entry, ".npy.z", {}, zlib.compress(buffer.getvalue(), 1))


def _read(entry, suffix):
    """``(header, payload)`` of an entry written by `_write`, or None; a corrupt one is deleted."""
    try:
        with open(_path(entry, suffix), "rb") as f:
            header = json.loads(f.readline())
            payload = f.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        remove(entry, suffix)
        return None
    if not isinstance(header, dict) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        remove(entry, suffix)
        return None
    return header, payload


def _write(entry, suffix, header, payload):
    """A JSON header line (``header`` and the payload's SHA-256), then ``payload``: written to a temporary file and
    renamed, so a reader never sees a partial entry; a read-only cache or a full disk leaves none."""
    path = _path(entry, suffix)
    line = json.dumps(dict(header, sha256=hashlib.sha256(payload).hexdigest())).encode()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(line + b"\n" + payload)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass


def remember(entry):
    """Keep a verdict that needs no content (`numbaflash.mods.compile_check`'s pass): an empty entry; a read-only
    cache is skipped."""
    path = _path(entry, ".ok")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "ab").close()
    except OSError:
        pass


def remembered(entry):
    return os.path.exists(_path(entry, ".ok"))


def remove(entry, suffix=".cubin"):
    try:
        os.remove(_path(entry, suffix))
    except OSError:
        pass
