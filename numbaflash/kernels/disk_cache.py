"""Compiled kernels kept on disk, so that a new process loads each kernel instead of compiling it again.

A compile costs about 3 seconds per kernel specialization; Triton and FlashAttention-4 cache theirs, and
so does numbaflash. An entry is the cubin and its entry point's name, stored under a key that covers
everything that changes the machine code: the source of every kernel module (`numbaflash.kernels` and
the mask bounds they share), the specialization (builder, head dim, tiles, dtype, launch bounds), the
GPU's compute capability, and the numba, numba-cuda, NVVM and driver versions.

The directory is ``$NUMBAFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/numbaflash``, else
``~/.cache/numbaflash``. Entries are written whole or not at all (a temporary file, then a rename); an
entry whose checksum does not match its cubin is deleted and the kernel is compiled again. Beside the
cubins it keeps empty ``.ok`` entries: verdicts that need no content (`remember`).
"""

import functools
import hashlib
import json
import os
import tempfile

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
    """SHA-256 of the kernel sources: every file under ``numbaflash/kernels`` and ``numbaflash/masks.py``."""
    digest = hashlib.sha256()
    kernels = os.path.join(_PACKAGE, "kernels")
    paths = [os.path.join(root, name) for root, _, names in os.walk(kernels) for name in names if name.endswith(".py")]
    for path in sorted(paths) + [os.path.join(_PACKAGE, "masks.py")]:
        digest.update(os.path.relpath(path, _PACKAGE).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def key(parts):
    """The entry name of a specialization: ``parts`` (a tuple of reprs) with the kernel sources' digest."""
    return hashlib.sha256(repr((source_digest(), parts)).encode()).hexdigest()


def _path(entry, suffix=".cubin"):
    return os.path.join(directory(), entry[:2], entry + suffix)


def load(entry):
    """``(entry_name, cubin)`` of a stored kernel, or None (absent; corrupt entries are deleted)."""
    path = _path(entry)
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            cubin = f.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        remove(entry)
        return None
    if not isinstance(header, dict) or header.get("sha256") != hashlib.sha256(cubin).hexdigest():
        remove(entry)
        return None
    return header["entry_name"], cubin


def store(entry, entry_name, cubin):
    """Write an entry whole (a reader never sees a partial file); a read-only cache is skipped."""
    path = _path(entry)
    header = json.dumps({"entry_name": entry_name, "sha256": hashlib.sha256(cubin).hexdigest()}).encode()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + b"\n" + cubin)
        os.replace(tmp, path)
    except OSError:  # a full disk, say: leave no partial file behind
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


def remove(entry):
    try:
        os.remove(_path(entry))
    except OSError:
        pass
