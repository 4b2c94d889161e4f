"""Block sparsity: which (query tile, key tile) pairs a mask_mod leaves empty, partial or full.

`block_mask` wraps a ``mask_mod`` and the problem's sizes; `BlockMask.classify` evaluates the mask on
every (b, h, q_idx, kv_idx) once (a Numba loop on the host), keeps the visible count of each 16 x 16
tile, and from those labels each tile of a kernel's shape `EMPTY` (no visible score), `PARTIAL` or
`FULL` (every score visible). A forward kernel, or a backward's dQ pass, given the `BlockMask` visits
only the non-empty key tiles of its query tile, in order (`key_tiles`); a backward's dK/dV pass visits
only the non-empty query tiles of its key block (`query_tiles`). On partial tiles the kernels of every
family read the mask's verdicts from bits evaluated here (a dK/dV pass's transposed) and call no
``mask_mod``. The forward's result is the dense mask_mod call's up to rounding: an empty tile adds exp(-inf) = 0
to the sums, but on a GPU the dense call's visit also rescales them by ex2 of the rounding error of
``m * scale`` (the FMA keeps it), one part in 2^24; on the simulator the two agree bit for bit. An empty
tile adds exact zeros to the gradients, so a deterministic backward's are the dense call's bit for bit.

The causal/window mask of the call is applied on top: a tile outside it is skipped as it always was, and the
schedules call a tile full only where that mask leaves it whole too (`BlockMask.unmasked`), so no kernel tests
anything on a full tile (the CUDA-core kernels since 2026-11-27). On the H100 that took the causal block mask's
backward at headdim 64 from 1.10-1.13x to 1.07-1.08x the built-in causal's time (fp16, N = 16384, 16 heads, two
interleaved runs, `.bench/bwd_ab.py`).
"""

import contextlib
import functools
import numbers
import threading

import numpy as np

from . import _arrays, masks, mods
from .kernels import disk_cache, function_keys

EMPTY, PARTIAL, FULL = 0, 1, 2
FINE = 16  # the tiles the mask's counts are kept at; kernel tiles that are multiples of it (all of today's) sum them
# Masks of at least this many scores are counted on every core: compiling the parallel loop costs about a
# second more, which small masks (the tests') need not pay.
PARALLEL_SCORES = 2 ** 24
# Numba's workqueue threading layer (where neither TBB nor OpenMP is installed) aborts the process when two
# Python threads run parallel code at once: one count at a time.
_PARALLEL_LOCK = threading.Lock()


class BlockMask:
    """A ``mask_mod`` over (batch, nheads, seqlen_q, seqlen_k); batch or nheads None when it does not depend
    on them (evaluated at 0, shared by all). ``mod_args``: NumPy arrays, the host copies of those the call
    passes."""

    def __init__(self, mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_args):
        self.mask_mod = mask_mod
        self.batch, self.nheads, self.seqlen_q, self.seqlen_k = batch, nheads, seqlen_q, seqlen_k
        self.mod_args = mod_args
        self._fine = None
        self._classes = {}
        self._visited = {}
        self._unmasked = {}
        self._tables = {}
        self._scores = {}  # (left, right) -> visible scores per (batch or 1, nheads or 1)

    def __repr__(self):
        return (f"BlockMask({self.mask_mod.__qualname__}, batch={self.batch}, nheads={self.nheads}, "
                f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k})")

    def check_sizes(self, batch, nheads, seqlen_q, seqlen_k):
        """ValueError unless the mask was made for these sizes (its None batch or nheads matches any)."""
        if (self.seqlen_q, self.seqlen_k) != (seqlen_q, seqlen_k) or self.batch not in (None, batch) \
                or self.nheads not in (None, nheads):
            raise ValueError(f"block_mask was made for (batch, nheads, seqlen_q, seqlen_k) = "
                             f"{(self.batch, self.nheads, self.seqlen_q, self.seqlen_k)}, not for "
                             f"{(batch, nheads, seqlen_q, seqlen_k)} (None matches any)")

    def classify(self, block_m, block_n):
        """int8 ``(batch or 1, nheads or 1, cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n))`` of EMPTY, PARTIAL, FULL."""
        if (block_m, block_n) not in self._classes:
            if block_m % FINE or block_n % FINE:
                counts = self._counts(block_m, block_n)
            else:  # summed from the fine tiles' counts: the mask is evaluated once, whatever the tile shapes
                counts = _tile_counts(self._fine_counts(), block_m // FINE, block_n // FINE)
            self._classes[block_m, block_n] = np.where(
                counts == 0, EMPTY, np.where(counts == block_m * block_n, FULL, PARTIAL)).astype(np.int8)
        return self._classes[block_m, block_n]

    def _counts(self, rows, cols, left=-1, right=-1):
        """Scores the mask_mod shows per ``rows`` x ``cols`` tile, among those the window ``(left, right)`` shows:
        int32 ``(batch or 1, nheads or 1, cdiv(seqlen_q, rows), cdiv(seqlen_k, cols))``, counted as the mask is
        evaluated (memory for the counts alone: a boolean array of every score took 9 bytes a score)."""
        counts = np.zeros((self.batch or 1, self.nheads or 1, -(-self.seqlen_q // rows), -(-self.seqlen_k // cols)),
                          np.int32)
        self._evaluate(_counting_loop, counts.size * rows * cols, (counts,), rows, cols, left, right)
        return counts

    def _evaluate(self, loop_of, scores, out, rows, cols, left, right):
        """Run ``loop_of(mask_mod, parallel)(*out, rows, cols, lo, hi, mod_args)`` (``out``: the loop's leading
        arguments, the array it fills first) over the rows' key ranges ``[lo, hi)`` in the window ``(left, right)``,
        on every core when it evaluates at least `PARALLEL_SCORES` ``scores``. The filled array is kept in the disk
        cache under everything it follows from (`_entry`), and loaded from there by a later mask of the same
        function, mod_args and sizes in any process: 8 documents' forward and backward tables at N = 16384 took a new
        process 0.09-0.12 s from there against 2.4-2.7 s, about 2 s of them compiling the loops for the mask_mod
        (this project's 2-core CPU machine)."""
        entry = self._entry(loop_of, out, rows, cols, left, right)
        stored = None if entry is None else disk_cache.load_array(entry)
        if stored is not None:  # of out[0]'s shape and dtype, which the entry holds
            out[0][...] = stored
            return
        lo, hi = np.array([masks.key_range(i, self.seqlen_q, self.seqlen_k, left, right)
                           for i in range(self.seqlen_q)], dtype=np.int64).T.copy()
        parallel = scores >= PARALLEL_SCORES
        with _PARALLEL_LOCK if parallel else contextlib.nullcontext():
            args = tuple(np.asarray(a) for a in self.mod_args)
            loop_of(self.mask_mod, parallel)(*out, rows, cols, lo, hi, args)
        if entry is not None:
            disk_cache.store_array(entry, out[0])

    def _entry(self, loop_of, out, rows, cols, left, right):
        """The disk-cache entry of one evaluation: the mask_mod's digest (`kernels.function_keys`), the mod_args'
        values, the sizes, the loop and its arguments; None where the mask_mod is `function_keys.Unkeyable` (it is
        then evaluated in every process, as its kernels are compiled)."""
        if self._mask_digest is None:
            return None
        return disk_cache.key(("block mask evaluation", self._mask_digest,
                               tuple(function_keys.array_key(a) for a in self.mod_args),
                               (self.batch, self.nheads, self.seqlen_q, self.seqlen_k), loop_of.__name__,
                               (rows, cols, left, right), out[0].shape, str(out[0].dtype),
                               tuple(function_keys.array_key(a) for a in out[1:])))

    @functools.cached_property
    def _mask_digest(self):
        return function_keys.digest_or_none(self.mask_mod)

    def _fine_counts(self):
        """Visible scores per FINE x FINE tile, counted once."""
        if self._fine is None:
            self._fine = self._counts(FINE, FINE)
        return self._fine

    def visited(self, block_m, block_n, left, right):
        """bool ``(batch or 1, nheads or 1, query tiles, key tiles)``: the tiles a forward visits, those the
        block mask finds not empty and the causal/window mask ``(left, right)`` does not hide (what
        `key_tiles` and `query_tiles` list for the kernels and `sim.count_io(block_mask=...)` counts), cached."""
        key = (block_m, block_n, left, right)
        if key not in self._visited:
            classes = self.classify(block_m, block_n)
            shown = np.zeros(classes.shape[2:], bool)
            tile_index = np.arange(classes.shape[3])
            for qt in range(classes.shape[2]):
                row_start = qt * block_m
                lo, hi = masks.block_key_range(row_start, min(row_start + block_m, self.seqlen_q), self.seqlen_q,
                                               self.seqlen_k, left, right)
                shown[qt] = (tile_index * block_n < hi) & ((tile_index + 1) * block_n > lo)
            self._visited[key] = (classes != EMPTY) & shown
        return self._visited[key]

    def mean_visits(self, block_m, block_n, left, right):
        """The key tiles of ``block_m`` x ``block_n`` a query block visits (`visited`), on average over the blocks,
        heads and batch elements, rounded down: the plan's measure of a block's work (`tiling.make_plan`'s
        ``block_visits``)."""
        return int(self.visited(block_m, block_n, left, right).sum(axis=-1).mean())

    def grid_order(self, block_m, block_n, left, right):
        """int32 ``(batch or 1, nheads or 1, query tiles)``: the query tile the ``x``-th block of a head's row of the
        grid runs (forward, dQ): the tiles that visit the most key tiles first, of equal ones the later rows first, as
        `kernels.blocks.query_blocks` orders rows without a block mask. Blocks start in blockIdx.x order; in row order
        each document's heaviest blocks come last among its own, and the last head's ran on alone at the grid's end.
        Ordered within each head (all heads' longest first would outrun L2: docs/performance.md, the persistent
        forward), 8 documents' forward at headdim 128 took 0.963x the time of the same kernel and table in row order
        (0.878-0.979 over eight ABBA pairs), at 64 1.001x (0.996-1.011), the backward 0.985x and 1.000x; a causal block
        mask's order is the rows' (H200, fp16, N = 16384, 16 heads, stream timing, `.bench/order_abba.py`)."""
        counts = self.visited(block_m, block_n, left, right).sum(axis=-1)
        last = counts.shape[-1] - 1
        # a stable sort of the reversed rows keeps the later of two equal rows first
        return (last - np.argsort(-counts[..., ::-1], axis=-1, kind="stable")).astype(np.int32)

    def key_tiles(self, block_m, block_n, left, right, like):
        """The forward's schedule (`kernels.key_tiles`): ``(table, bits)``, arrays of the kind and device of
        `_arrays.Operand` ``like``, cached.

        ``table``: int32 ``(batch or 1, nheads or 1, query tiles, 2 (key tiles + 1) + 1)``; entry 0 of a query tile
        counts the key tiles it visits (`visited`), entries 1.. are ``2 * key tile + (1 if `unmasked`)``, ascending,
        entry ``key tiles + 2 + i`` is the ``i``-th visited tile's slot in ``bits`` (-1 for a full one), and the
        last entry of row ``x`` is `grid_order`'s ``x``-th query tile.
        ``bits``: int32 ``(partial tiles or 1, block_m, words)``, ``words = cdiv(block_n, 32)``: bit ``c % 32``
        of word ``c // 32`` of row ``r`` of a slot is mask_mod's verdict on its tile's row ``r``, key ``c``,
        where the call's causal/window mask shows it inside the sequences (0 elsewhere)."""
        key = (block_m, block_n, left, right, like.kind, like.device)
        if key not in self._tables:
            whole, visited = self.unmasked(block_m, block_n, left, right), self.visited(block_m, block_n, left, right)
            ktiles = whole.shape[3]
            # One spare entry past the last tile: kernels read the next tile's start before they test the count.
            table = np.zeros(whole.shape[:3] + (2 * (ktiles + 1) + 1,), np.int32)
            table[..., -1] = self.grid_order(block_m, block_n, left, right)
            partial = []  # (b, h, query tile, key tile) of each slot, in slot order
            for b, h, qt in np.ndindex(*whole.shape[:3]):
                tiles = np.flatnonzero(visited[b, h, qt])
                full = whole[b, h, qt, tiles]
                _schedule_row(table[b, h, qt], tiles, full, len(partial))
                partial += [(b, h, qt, tile) for tile in tiles[~full]]
            bits = self._partial_bits(np.array(partial, np.int64).reshape(-1, 4), block_m, block_n, left, right)
            self._tables[key] = (_arrays.from_host(like, table), _arrays.from_host(like, bits))
        return self._tables[key]

    def unmasked(self, block_m, block_n, left, right):
        """bool ``(batch or 1, nheads or 1, query tiles, key tiles)``: the FULL tiles (`classify`) that the
        causal/window mask ``(left, right)`` and the sequences' ends also leave whole (`masks.tile_is_full` of the
        tile's rows inside seqlen_q), cached. The schedules' full bit (`key_tiles`, `query_tiles`): no kernel tests
        anything on such a tile, neither the mask_mod nor the causal/window mask; a tile full to the mask_mod alone
        takes a slot, whose bits hold both."""
        key = (block_m, block_n, left, right)
        if key not in self._unmasked:
            classes = self.classify(block_m, block_n)
            starts = np.arange(classes.shape[3]) * block_n
            whole = np.array([[masks.tile_is_full(qt * block_m, min(qt * block_m + block_m, self.seqlen_q), int(c),
                                                  int(c) + block_n, self.seqlen_q, self.seqlen_k, left, right)
                               for c in starts] for qt in range(classes.shape[2])], bool)
            self._unmasked[key] = (classes == FULL) & whole
        return self._unmasked[key]

    def _partial_bits(self, tiles, block_m, block_n, left, right):
        """int32 ``(len(tiles) or 1, block_m, cdiv(block_n, 32))``: the mask_mod's verdicts on each of ``tiles``
        (rows of ``(b, h, query tile, key tile)``), as `key_tiles` lays them out (32-bit words as int32:
        torch moves no uint32 tensor to a GPU)."""
        bits = np.zeros((max(1, len(tiles)), block_m, -(-block_n // 32)), np.uint32)
        self._evaluate(_bits_loop, len(tiles) * block_m * block_n, (bits, tiles), block_m, block_n, left, right)
        return bits.view(np.int32)

    def query_tiles(self, block_m, block_n, left, right, group, like):
        """A dK/dV pass's schedule (`kernels.query_tiles`) for blocks of ``block_m`` keys streaming tiles of
        ``block_n`` query rows, GQA groups of ``group`` query heads: ``(table, bits)`` as `key_tiles` lays them
        out, transposed. ``table``: int32 ``(batch or 1, kv heads or 1, key blocks, 2 (visits + 1))``, visits
        ``= group * query tiles``; entry 0 of a key block counts the (head, query tile) pairs it visits
        (`visited`'s tiles, over the group's heads), entries 1.. are ``2 * (j * query tiles + query tile) +
        (1 if `unmasked`)`` for the group's ``j``-th head, heads in order, tiles ascending, and entry ``visits + 2 + i``
        is the ``i``-th visit's slot in ``bits`` (-1 for a full one). ``bits``: int32 ``(partial visits or 1,
        block_m, cdiv(block_n, 32))``: bit ``c % 32`` of word ``c // 32`` of row ``r`` is mask_mod's verdict on
        key ``r`` of the block and query row ``c`` of the tile, where the causal/window mask shows it inside
        the sequences (0 elsewhere). Arrays of the kind and device of `_arrays.Operand` ``like``, cached."""
        key = ("query", block_m, block_n, left, right, group, like.kind, like.device)
        if key not in self._tables:
            whole, visited = self.unmasked(block_n, block_m, left, right), self.visited(block_n, block_m, left, right)
            batch, heads, per_head, key_blocks = whole.shape
            kv_heads = heads // group if heads > 1 else 1  # a mask of any head: every group's the same
            visits = group * per_head
            table = np.zeros((batch, kv_heads, key_blocks, 2 * (visits + 1)), np.int32)
            partial = []  # (b, h, query tile, key block) of each slot, in slot order
            for b, hk, kt in np.ndindex(batch, kv_heads, key_blocks):
                first_slot, pairs, fulls = len(partial), [], []
                for j in range(group):
                    h = hk * group + j if heads > 1 else 0
                    tiles = np.flatnonzero(visited[b, h, :, kt])
                    full = whole[b, h, tiles, kt]
                    pairs.append(j * per_head + tiles)
                    fulls.append(full)
                    partial += [(b, h, tile, kt) for tile in tiles[~full]]
                _schedule_row(table[b, hk, kt], np.concatenate(pairs), np.concatenate(fulls), first_slot)
            # The verdicts of (query rows x keys) tiles, transposed to (keys x query rows) words
            rows = self._partial_bits(np.array(partial, np.int64).reshape(-1, 4), block_n, block_m, left, right)
            # (a C-contiguous array to pack: np.pad of the transposed view kept its strides on NumPy 2.4)
            shown = np.zeros((len(rows), block_m, 32 * -(-block_n // 32)), np.uint8)
            verdicts = np.unpackbits(rows.view(np.uint8), axis=2, bitorder="little")[:, :, :block_m]  # (P, rows, keys)
            shown[:, :, :block_n] = verdicts.transpose(0, 2, 1)
            bits = np.packbits(shown, axis=2, bitorder="little").view(np.int32)
            self._tables[key] = (_arrays.from_host(like, table), _arrays.from_host(like, bits))
        return self._tables[key]

    def visible_scores(self, left, right, batch, nheads):
        """Scores that both the mask_mod and the causal/window mask ``(left, right)`` show, summed over a call's
        ``batch`` and ``nheads`` (a shared axis counts for each): `sim.hardware`'s FLOPs. The mask is evaluated
        again on the host over the window's scores, once per window."""
        if (left, right) not in self._scores:
            self._scores[left, right] = self._counts(FINE, self.seqlen_k, left, right).sum(axis=(2, 3))
        count = self._scores[left, right]
        return int(count.sum()) * (batch // count.shape[0]) * (nheads // count.shape[1])

    def density(self, block_m, block_n):
        """The fraction of tiles that are not empty."""
        return float(np.mean(self.classify(block_m, block_n) != EMPTY))


def _schedule_row(row, visits, full, first_slot):
    """Fill a block's ``row`` of a schedule table (`BlockMask.key_tiles`, `query_tiles`): its count, each visit as
    ``2 * visit + (1 if full)``, and after the spare entry each visit's slot in the bits, the partial ones
    numbered from ``first_slot`` in order, -1 for a full one."""
    n, half = len(visits), len(row) // 2
    row[0] = n
    row[1:1 + n] = 2 * visits + full
    row[half + 1:half + 1 + n] = np.where(full, -1, first_slot + np.cumsum(~full) - 1)


def _tile_counts(values, rows, cols):
    """Sums of ``values`` (b, h, m, n) over tiles of ``rows`` x ``cols``; entries past the edge count 0, so an
    edge tile is never full."""
    b, h, m, n = values.shape
    nq, nk = -(-m // rows), -(-n // cols)
    if (nq * rows, nk * cols) != (m, n):
        padded = np.zeros((b, h, nq * rows, nk * cols), values.dtype)
        padded[:, :, :m, :n] = values
        values = padded
    return values.reshape(b, h, nq, rows, nk, cols).sum(axis=(3, 5), dtype=np.int64)


@functools.lru_cache(maxsize=None)
def _counting_loop(mask_mod, parallel):
    """A Numba loop adding to ``counts[b, h, i // rows, j // cols]`` each score ``mask_mod(b, h, i, j, *args)`` shows
    among the keys ``[lo[i], hi[i])`` of row ``i``, tile column by tile column (no division per score); with
    ``parallel``, the rows of tiles run on every core (each owns its row of counts)."""
    import numba

    f = numba.njit(mask_mod)

    @numba.njit(parallel=parallel)
    def count(counts, rows, cols, lo, hi, args):
        for b in range(counts.shape[0]):
            for h in range(counts.shape[1]):
                for row_tile in numba.prange(counts.shape[2]):
                    for i in range(row_tile * rows, min(lo.shape[0], row_tile * rows + rows)):
                        for tile in range(lo[i] // cols, (hi[i] + cols - 1) // cols):
                            seen = 0
                            for j in range(max(lo[i], tile * cols), min(hi[i], tile * cols + cols)):
                                if f(b, h, i, j, *args):
                                    seen += 1
                            counts[b, h, row_tile, tile] += seen

    return count


@functools.lru_cache(maxsize=None)
def _bits_loop(mask_mod, parallel):
    """A Numba loop setting ``bits[s, r, c // 32]``'s bit ``c % 32`` where ``mask_mod`` shows row ``r``, key ``c``
    of tile ``tiles[s] = (b, h, query tile, key tile)`` among the keys ``[lo[i], hi[i])`` of its row ``i``; with
    ``parallel``, the tiles run on every core (each owns its slot)."""
    import numba

    f = numba.njit(mask_mod)

    @numba.njit(parallel=parallel)
    def fill(bits, tiles, rows, cols, lo, hi, args):
        for slot in numba.prange(tiles.shape[0]):
            b, h, row_tile, tile = tiles[slot, 0], tiles[slot, 1], tiles[slot, 2], tiles[slot, 3]
            for r in range(rows):
                i = row_tile * rows + r
                if i >= lo.shape[0]:
                    break
                for j in range(max(lo[i], tile * cols), min(hi[i], tile * cols + cols)):
                    if f(b, h, i, j, *args):
                        c = j - tile * cols
                        bits[slot, r, c // 32] |= np.uint32(1) << np.uint32(c % 32)

    return fill


def _size(value, name, optional=False):
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None (the mask does not depend on it)' if optional else ''}; "
                         f"got {value!r}")
    return int(value)


def block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, *, mod_args=()):
    """A `BlockMask` of ``mask_mod(b, h, q_idx, kv_idx, *mod_args)``, for `numbaflash.attention(..., block_mask=)`.

    Args:
        mask_mod: as `numbaflash.attention` takes it.
        batch, nheads: the call's sizes, or None where the mask does not depend on b (h): one
            evaluation then serves every batch element (head).
        seqlen_q, seqlen_k: the call's sequence lengths.
        mod_args: the arrays the mask reads (NumPy, or any array with ``.get()`` / ``.cpu()``: read to the
            host once); the call passes the same arrays in its own ``mod_args``.

    The mask is evaluated on the host, on every score of one (batch or 1) x (nheads or 1) grid, once, when
    a kernel first asks for its tiles: 0.13 s for 2^28 scores of a document mask on this project's 2-core CPU machine,
    after about a second compiling the mask_mod for the CPU. What it finds is kept in the disk cache
    (`BlockMask._evaluate`), where a later process's mask of the same function, mod_args and sizes finds it.
    """
    batch, nheads = _size(batch, "batch", optional=True), _size(nheads, "nheads", optional=True)
    seqlen_q, seqlen_k = _size(seqlen_q, "seqlen_q"), _size(seqlen_k, "seqlen_k")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got {type(mod_args).__name__}")
    host = tuple(_to_host(a, f"mod_args[{i}]") for i, a in enumerate(mod_args))
    mods.check(0.0, None, None, None, mask_mod, host, _describe_host, batch or 1, nheads or 1)
    if mask_mod is None:
        raise ValueError("block_mask needs a mask_mod")
    return BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, host)


def _to_host(x, name):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):  # CuPy
        return x.get()
    if hasattr(x, "cpu"):  # torch
        return x.detach().cpu().numpy()
    raise TypeError(f"{name} must be a NumPy, CuPy or torch array; got {type(x).__module__}.{type(x).__name__}")


def _describe_host(x, name):
    return _arrays.Operand(x, "numpy", x.shape, x.strides, str(x.dtype), -1, 0)
