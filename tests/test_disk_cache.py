"""The on-disk cache of compiled kernels: keys (the user's functions' among them), whole writes, corrupt entries, and a
second process's first call; block masks' evaluations kept beside them."""

import enum
import functools
import math
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import numbaflash
from numbaflash import _arrays, block_sparsity
from numbaflash.kernels import compiled, disk_cache, function_keys
from numbaflash.kernels.wgmma import forward as wgmma_forward
from numbaflash.mods import Mods
from numbaflash.tiling import WgmmaTiles


def test_entries_round_trip_and_keys_follow_every_part(cache_dir):
    parts = ("numbaflash.kernels.wgmma_forward", "build", 128, "WgmmaTiles(128, 64, 2)", "float16", None, (9, 0))
    entry = disk_cache.key(parts)
    assert disk_cache.load(entry) is None
    disk_cache.store(entry, "_Z6kernel", b"\x7fELF cubin bytes")
    assert disk_cache.load(entry) == ("_Z6kernel", b"\x7fELF cubin bytes")
    assert str(cache_dir) in disk_cache._path(entry)
    for i in range(len(parts)):  # any part of the specialization gives another entry
        changed = parts[:i] + ("other",) + parts[i + 1:]
        assert disk_cache.key(changed) != entry
    assert disk_cache.key(parts) == entry and len(disk_cache.source_digest()) == 64


@pytest.mark.parametrize("damage", [lambda data: data[:-3], lambda data: b"not json\n" + data, lambda data: b""])
def test_a_corrupt_entry_is_removed_and_reads_as_absent(cache_dir, damage):
    entry = disk_cache.key(("corrupt",))
    disk_cache.store(entry, "_Z6kernel", b"0123456789")
    path = disk_cache._path(entry)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    assert disk_cache.load(entry) is None
    assert not os.path.exists(path)


@pytest.mark.gpu
def test_a_second_process_loads_the_kernel_instead_of_compiling(tmp_path, monkeypatch):
    """The first call of a new process costs well under a second once the cache holds its kernel; a
    corrupted entry is compiled again and rewritten."""
    script = textwrap.dedent("""
        import time, cupy, numbaflash
        q = cupy.random.standard_normal((1, 1024, 4, 128), dtype=cupy.float32).astype(cupy.float16)
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        numbaflash.attention(q, q, q, causal=True)
        cupy.cuda.Device().synchronize()
        print(time.perf_counter() - start)
    """)
    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))
    run = lambda: float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True).stdout.split()[-1])
    cold = run()
    entries = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".cubin")]
    assert len(entries) == 1
    warm = run()
    print(f"first call: {cold:.2f} s compiling, {warm:.2f} s from the cache")
    assert warm < 1.0 and warm < cold / 2
    with open(entries[0], "r+b") as f:  # flip the cubin's last byte: the checksum no longer matches
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    rebuilt = run()
    assert rebuilt > warm and disk_cache.load(os.path.basename(entries[0])[:-6]) is not None


# -- the user's functions: keyed by what Numba compiles of them (`function_keys`)

def _entries(folder, suffix=".cubin"):
    """How many cache entries of this kind ``folder`` holds."""
    return sum(name.endswith(suffix) for _, _, names in os.walk(folder) for name in names)


def _defined(source, name="f", filename="<user>", **scope):
    """A function compiled from ``source`` in a fresh module scope holding ``scope``."""
    namespace = {"math": math, "np": np, **scope}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace[name]


BIAS_SOURCE = """
def f(score, b, h, q_idx, kv_idx):
    return score + SCALE * TABLE[(q_idx - kv_idx) % 4] + helper(q_idx)
"""


def _bias_scope(scale=0.5, table=(1.0, 2.0, 3.0, 4.0), helper="def helper(i):\n    return i * 0.25\n"):
    return dict(SCALE=scale, TABLE=np.array(table, dtype=np.float32), helper=numba.njit(_defined(helper, "helper")))


def test_a_user_function_s_key_follows_its_code_and_every_value_it_reads():
    base = function_keys.digest(_defined(BIAS_SOURCE, **_bias_scope()))
    assert base == function_keys.digest(_defined(BIAS_SOURCE, **_bias_scope()))  # a new object, the same function
    # lines added above it and another file name leave its kernels' code, and its key, as they were
    assert base == function_keys.digest(_defined("\n\n\n" + BIAS_SOURCE, filename="<moved>", **_bias_scope()))
    changed = {
        "its code": _defined(BIAS_SOURCE.replace("score +", "score -"), **_bias_scope()),
        "a constant in it": _defined(BIAS_SOURCE.replace("% 4", "% 3"), **_bias_scope()),
        "a global number": _defined(BIAS_SOURCE, **_bias_scope(scale=0.25)),
        "a global array's values": _defined(BIAS_SOURCE, **_bias_scope(table=(1.0, 2.0, 3.0, 5.0))),
        "a global array's dtype": _defined(BIAS_SOURCE, **{**_bias_scope(), "TABLE": np.arange(1.0, 5.0)}),
        "a function it calls": _defined(BIAS_SOURCE, **_bias_scope(helper="def helper(i):\n    return i * 0.5\n")),
    }
    for what, fn in changed.items():
        assert function_keys.digest(fn) != base, what

    def closure(weight):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * weight
        return score_mod

    assert function_keys.digest(closure(2.0)) == function_keys.digest(closure(2.0))
    assert function_keys.digest(closure(2.0)) != function_keys.digest(closure(3.0))


def test_a_user_function_s_key_is_the_same_in_every_process():
    """String sets iterate in an order that changes with each process's hash seed; the key must not."""
    script = textwrap.dedent("""
        import numpy as np
        from numbaflash.kernels import function_keys
        DOCS = np.array([0, 0, 1, 1], dtype=np.int32)
        def mask_mod(b, h, q_idx, kv_idx):
            return DOCS[q_idx] == DOCS[kv_idx] and "a" in {"w", "x", "y", "z"}
        print(function_keys.digest(mask_mod))
    """)
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "3")}
    assert len(digests) == 1 and len(digests.pop()) == 64


class Kind(enum.IntEnum):  # Numba compiles an IntEnum's members; the key does not follow a class of the user's
    BIAS = 2


def test_a_function_reading_a_value_no_key_sees_into_is_left_out_of_the_disk_cache():
    fn = _defined("def f(score, b, h, q_idx, kv_idx):\n    return score + (q_idx == Kind.BIAS)\n", Kind=Kind)
    with pytest.raises(function_keys.Unkeyable, match="f's global 'Kind', of type enum"):
        function_keys.digest(fn)
    mods = Mods(score_mod=fn)
    key, why = function_keys.mods_key(mods)
    assert key is None and "'Kind'" in why
    assert compiled.kernel(wgmma_forward.build, 64, WgmmaTiles(64, 64, 1), "float16", 128, mods)._specialization is None
    keyed = Mods(score_mod=_defined(BIAS_SOURCE, **_bias_scope()))
    specialization = compiled.kernel(wgmma_forward.build, 64, WgmmaTiles(64, 64, 1), "float16", 128, keyed)._specialization
    assert specialization[-1] == function_keys.mods_key(keyed)[0]
    q = np.zeros((1, 16, 1, 16), dtype=np.float16)
    assert "never from the disk cache: f's global 'Kind'" in numbaflash.explain(q, q, q, score_mod=fn)
    assert "kept in the disk cache" in numbaflash.explain(q, q, q, score_mod=keyed.score_mod)


@pytest.mark.gpu
def test_a_score_mod_kernel_is_loaded_by_a_new_process_and_never_stale(tmp_path, monkeypatch):
    """score_mod multiplies each score by a global WEIGHT, as softmax_scale * WEIGHT does: a process with another
    WEIGHT compiles its own kernel (a stale one would give the first weight's answer), and one with the first
    WEIGHT again loads the first process's kernel."""
    script = textwrap.dedent("""
        import sys, time, cupy, numbaflash
        WEIGHT = float(sys.argv[1])
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * WEIGHT
        q, k, v = (cupy.random.standard_normal((1, 1024, 4, 64), dtype=cupy.float32).astype(cupy.float16)
                   for _ in range(3))
        expected = numbaflash.attention(q, k, v, softmax_scale=0.125 * WEIGHT)
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        out = numbaflash.attention(q, k, v, softmax_scale=0.125, score_mod=score_mod)
        cupy.cuda.Device().synchronize()
        print(time.perf_counter() - start, float(abs(out.astype(cupy.float32) - expected.astype(cupy.float32)).max()))
    """)
    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))

    def run(weight):
        first_call, error = map(float, subprocess.run([sys.executable, "-c", script, str(weight)], capture_output=True,
                                                      text=True, check=True).stdout.split()[-2:])
        entries = _entries(tmp_path)
        return first_call, error, entries

    cold, error, entries = run(1.0)
    other, other_error, other_entries = run(3.0)
    warm, warm_error, warm_entries = run(1.0)
    print(f"score_mod's first call: {cold:.2f} s compiling, {warm:.2f} s from the cache; another weight {other:.2f} s; "
          f"max |out - softmax_scale's| {error:.2e}, {other_error:.2e}, {warm_error:.2e}; entries {entries}, "
          f"{other_entries}, {warm_entries}")
    assert max(error, other_error, warm_error) < 1e-2  # a stale kernel: a weight of 1 for 3, errors near 0.1-1
    assert other_entries > entries and warm_entries == other_entries
    assert warm < 1.0 and warm < cold / 2


def test_a_function_s_compile_check_is_remembered_under_its_digest(cache_dir, monkeypatch):
    """`mods.compile_check` passes a function whose digest passed before without compiling it (a new function object
    of the same code: its per-process cache misses); one that fails is never remembered."""
    from numbaflash import mods

    first, same, other = (_defined(BIAS_SOURCE, **_bias_scope(scale=scale)) for scale in (0.5, 0.5, 0.25))
    mods.compile_check(first, "score_mod", "a number", ())
    assert _entries(cache_dir, ".ok") == 1

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(numba, "njit", refuse)
    mods.compile_check(same, "score_mod", "a number", ())
    with pytest.raises(AssertionError, match="compiled again"):  # another constant: another digest
        mods.compile_check(other, "score_mod", "a number", ())
    with pytest.raises(AssertionError, match="compiled again"):  # other argument types
        mods.compile_check(same, "score_mod", "a number", (("float32", 1),))
    monkeypatch.undo()
    for _ in range(2):
        with pytest.raises(TypeError, match="cannot be compiled by Numba"):
            mods.compile_check(_defined("def f(score, b, h, q_idx, kv_idx):\n    return score + undefined_name\n"),
                               "score_mod", "a number", ())
    assert _entries(cache_dir, ".ok") == 1


def test_an_array_entry_round_trips_and_a_corrupt_one_reads_as_absent(cache_dir):
    entry = disk_cache.key(("array",))
    counts = np.arange(12, dtype=np.int32).reshape(1, 1, 3, 4)
    disk_cache.store_array(entry, counts)
    stored = disk_cache.load_array(entry)
    assert stored.dtype == counts.dtype and np.array_equal(stored, counts)
    path = disk_cache._path(entry, ".npy.z")
    with open(path, "r+b") as f:
        f.seek(-2, os.SEEK_END)
        f.write(b"??")
    assert disk_cache.load_array(entry) is None and not os.path.exists(path)


def same_document_causal(b, h, q_idx, kv_idx, doc):
    return doc[0, q_idx] == doc[0, kv_idx] and kv_idx <= q_idx


def _evaluated(mask_mod, doc, seqlen=100):
    """What a block mask of ``mask_mod`` over one head computes on the host: classes at a shape summed from the fine
    tiles and at one evaluated again (24 rows), a forward's and a dK/dV pass's schedules with their bits, and the
    visible scores under a window."""
    bm = numbaflash.block_mask(mask_mod, None, None, seqlen, seqlen, mod_args=(doc,))
    like = _arrays.Operand(doc, "numpy", doc.shape, doc.strides, "int32", -1, 0)
    tables = bm.key_tiles(32, 16, -1, 0, like) + bm.query_tiles(16, 32, 5, 2, 1, like)
    return [bm.classify(64, 32), bm.classify(24, 16)] + [t.obj for t in tables] + [bm.visible_scores(7, 3, 1, 1)]


def _failing_loops(monkeypatch):
    """The block masks' host loops replaced by ones that fail (under the loops' names, which the entries hold)."""
    for loop in ("_counting_loop", "_bits_loop"):
        @functools.wraps(getattr(block_sparsity, loop))
        def evaluate(*args):
            raise AssertionError("the mask was evaluated again")

        monkeypatch.setattr(block_sparsity, loop, evaluate)


def test_a_block_mask_s_evaluation_is_loaded_by_a_later_mask_of_the_same_function_and_arguments(cache_dir,
                                                                                               monkeypatch):
    """A block mask keeps each evaluation of its mask_mod on disk under the function's digest, the mod_args'
    values, the sizes and the loop's arguments: a later mask of the same (a new process's, here a new object
    whose loops would fail) loads every result, equal to the first; other document ids, another function or
    other sizes evaluate again."""
    doc = np.repeat(np.arange(3), [20, 33, 47]).astype(np.int32)[None]
    first = _evaluated(same_document_causal, doc)
    assert _entries(cache_dir, ".npy.z") >= 4  # fine counts, 24-row counts, both passes' bits, window counts
    _failing_loops(monkeypatch)
    again = _evaluated(same_document_causal, doc.copy())
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    other_ids = np.repeat(np.arange(3), [21, 32, 47]).astype(np.int32)[None]
    body_changed = _defined("def f(b, h, q_idx, kv_idx, doc):\n    return doc[0, q_idx] == doc[0, kv_idx] and "
                            "kv_idx < q_idx\n")
    for mask_mod, ids, seqlen in [(same_document_causal, other_ids, 100), (body_changed, doc, 100),
                                  (same_document_causal, doc[:, :90], 90)]:
        with pytest.raises(AssertionError, match="evaluated again"):
            _evaluated(mask_mod, ids, seqlen)


def test_a_block_mask_whose_function_has_no_key_is_evaluated_in_every_process(cache_dir, monkeypatch):
    """A mask_mod reading a value the digest cannot see into (`function_keys.Unkeyable`) keeps nothing on disk: its
    evaluation is never loaded, as its kernels are never loaded."""
    fn = _defined("def f(b, h, q_idx, kv_idx, doc):\n    return kv_idx + Kind.BIAS <= q_idx + 2\n", Kind=Kind)
    doc = np.zeros((1, 50), np.int32)
    first = _evaluated(fn, doc, 50)
    assert _entries(cache_dir, ".npy.z") == 0
    _failing_loops(monkeypatch)
    with pytest.raises(AssertionError, match="evaluated again"):
        _evaluated(fn, doc, 50)
    assert first[0].shape == (1, 1, 1, 2)
