"""The on-disk cache of compiled kernels: keys, whole writes, corrupt entries, and a second process's first call."""

import os
import subprocess
import sys
import textwrap

import pytest

from numbaflash.kernels import disk_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))
    return tmp_path


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
