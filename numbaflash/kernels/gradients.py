"""The backward's named steps on tensor-core score fragments, shared by the mma.sync and wgmma backwards.

Both families hold a warp's score tile in the accumulator layout (`fragments`): ``M`` m-tiles of 16 rows,
``NT`` 8-column chunks, lane ``4 g + t`` at rows ``g``, ``g + 8`` and columns ``8 j + 2 t``, ``+ 1``. The
dK/dV kernels compute the transposed tiles (rows are keys, columns query rows), the dQ kernels the
plain ones (rows are query rows, columns keys). The steps, after the score products:

* `transposed_steps` -> ``probabilities(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, key_start,
  key_end, ..., block_full, mod, slot)``: S^T of query rows ``q_start + c0 ..`` (columns ``c0 ..`` of a tile of
  rows from ``q_start``) becomes P^T = exp2(logit(S^T) - LSE) in place, 0 where the mask hides the score
  (``block_full``: a block mask found the mask_mod and the causal/window mask true on the whole tile
  (`BlockMask.unmasked`), so neither is tested; otherwise, with a block mask, its verdicts come from the tile's
  transposed bits at ``slot``, and mask_mod is not called), and
  with score modifications ``dlogit`` the modification's derivative; the LSE of tile column ``c`` is
  ``stats[lse_at + c]``.
  ``ds(s, dp, dlogit, stats, delta_at, t)``: dP^T becomes dS^T = P^T (dP^T - D) (times ``dlogit``), D of
  column ``c`` at ``stats[delta_at + c]``.
* `row_steps` -> ``(rows, ds)``: ``rows(lse2, dsum, lo_r, hi_r, lse, delta, ...)`` loads a warp's rows'
  base-2 LSE, D (or both from a staged preprocess's ``stats`` in place of ``delta``) and visible key range
  into registers once; ``ds(s, dp, lse2, dsum, lo_r, hi_r, full, ..., block_full, mod, slot, row_start, c0)``
  turns S and dP of a row tile into dS in ``dp`` (``full``: the causal/window mask shows the whole tile;
  ``block_full``: so does the mask_mod, and ``full`` is then not tested; otherwise, with a block mask, the rows
  read its verdicts on the tile from its bits at ``slot`` (`key_tiles.verdict_slot`), columns from ``c0`` of the
  tile, as the forward's `softmax` mask does, and mask_mod is not called).
* `stats_stager` -> ``(load, store, per_thread)``: a query tile's LSE and D, loaded to registers early
  (their latency hides behind the tile's products) and stored to shared memory after.

Every step works in base 2 (``scale_log2``); the kernels scale dK and dQ by ln 2 at the end
(`mods`' ``natural``).
"""

import math

from numba import types

from .. import masks
from ..mods import NONE
from . import key_tiles
from .fragments import lane_row
from .intrinsics import device_function, ex2
from .mods import alibi_side, modifiers
from .simt.backward import row_statistics

ZERO, LOG2E = types.float32(0), types.float32(math.log2(math.e))


def guarded(mods):
    """Whether a score must pass the bounds and visibility checks before the modifications see it: the user's
    functions read mod_args at in-bounds visible indices only (a score_mod alone is then given a visible pair's
    indices instead: `_transposed_probabilities`' ``CLAMPED``); softcap and ALiBi are safe on any score, rows
    past the sequence included (their P is 0), and pay no branch per score."""
    return bool(mods.user_functions)


def untested_tile(mods):
    """``untested(full, block_full, rows_end, seqlen_q)``: whether a tile's scores skip the per-score tests: the
    causal/window mask shows it whole (``full``) and the user's functions, if any, may see all its indices (a
    mask_mod only where the block mask found the tile full, and every row ``< rows_end`` in the sequence). At
    headdim 64 the tests were most of the backward's dK/dV kernel's instructions (ncu, H100: ALU the busiest
    pipe at 40%, 2.4x the dQ kernel's instructions for a third more products)."""
    GUARDED, MASKED = guarded(mods), mods.mask_mod is not None

    @device_function
    def untested(full, block_full, rows_end, seqlen_q):
        return full and (not GUARDED or ((block_full or not MASKED) and rows_end <= seqlen_q))

    return untested


def transposed_steps(M, NT, mods=NONE, fused=False):
    """``(probabilities, ds)`` for transposed tiles of ``M`` m-tiles of 16 keys and ``8 NT`` query columns.
    ``fused``: ``probabilities`` also turns the finished dP^T into dS^T, score by score, so no ``dlogit`` is
    kept (``ds`` is then not needed)."""
    M_ROWS = 2 * M
    MODIFIED = modifiers(mods, types.float32, fast=True).modified
    untested = untested_tile(mods)
    # softcap and ALiBi without the user's functions form every score and drop the hidden ones after, as the
    # forward does: one loop with a branch around their arithmetic stayed rolled, S^T and dlogit in local
    # memory (256 bytes at headdim 64, ptxas 13.0) and a wgmma wait injected (C7517). The plain scores keep
    # the branch (forming them all spilled 16 bytes at headdim 128), the user's functions must (they see
    # visible indices only).
    FORM_ALL = MODIFIED and not guarded(mods)
    # A block mask's partial tiles read their verdicts in a loop of their own: as one more branch of the tested
    # loop, NVVM left it rolled, S^T in 128 bytes of local memory and a wgmma wait injected (C7517; ptxas 13.0,
    # v5 at headdim 64 and 128), as calling the mask_mod there did with 8 documents' lookups.
    checked, unchecked, from_bits = (_transposed_probabilities(M, NT, mods, tested, fused, bits)
                                     for tested, bits in ((True, False), (False, False), (True, True)))
    BITS = mods.block_sparse
    FUSED = fused
    # Not fused (headdim 128), where the one-sided loop beside the others kept 52 bytes of local memory (ptxas
    # 13.0) and ALiBi cost 1.03x the plain backward without it (H200)
    ALIBI = mods.alibi_alone and not guarded(mods) and not fused
    sided = _alibi_transposed(M, NT, mods, fused)

    @device_function
    def drop_hidden(s, dp, q_start, c0, warp_key, g, t, seqlen_q, seqlen_k, left, right):
        for j in range(NT):
            for e in range(2):
                lo_q, hi_q = masks.key_range(q_start + c0 + 8 * j + 2 * t + e, seqlen_q, seqlen_k, left, right)
                for r in range(M_ROWS):
                    key = warp_key + lane_row(r, g)
                    if key < lo_q or key >= hi_q:  # dS^T = P^T (...) dlogit is then 0 too: dlogit stays as formed
                        s[(r // 2) * NT + j, 2 * (r % 2) + e] = ZERO
                        if FUSED:
                            dp[(r // 2) * NT + j, 2 * (r % 2) + e] = ZERO

    @device_function
    def probabilities(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, key_start, key_end, g, t, seqlen_q,
                      seqlen_k, left, right, scale_log2, b, h, bh, block_full, mod, slot):
        q_end = q_start + c0 + 8 * NT
        # a block mask's full tile is whole to the causal/window mask too (`BlockMask.unmasked`): no test
        full = block_full or masks.tile_is_full(q_start + c0, min(q_end, seqlen_q), key_start, key_end, seqlen_q,
                                                seqlen_k, left, right)
        if FORM_ALL or untested(full, block_full, q_end, seqlen_q):
            side = alibi_side(warp_key, warp_key + 16 * M, q_start + c0, q_end, seqlen_k - seqlen_q) if ALIBI else 0
            if side != 0:
                sided(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, side, g, t, seqlen_q, seqlen_k,
                      scale_log2, bh)
            else:
                unchecked(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, full, g, t, seqlen_q, seqlen_k,
                          left, right, scale_log2, b, h, bh, block_full, mod, slot, key_start)
            if FORM_ALL and not full:
                drop_hidden(s, dp, q_start, c0, warp_key, g, t, seqlen_q, seqlen_k, left, right)
        elif BITS and not block_full:  # a block mask's partial tile
            from_bits(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, full, g, t, seqlen_q, seqlen_k, left,
                      right, scale_log2, b, h, bh, block_full, mod, slot, key_start)
        else:
            checked(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, full, g, t, seqlen_q, seqlen_k, left,
                    right, scale_log2, b, h, bh, block_full, mod, slot, key_start)

    @device_function
    def ds(s, dp, dlogit, stats, delta_at, t):
        delta_lane = stats[delta_at + 2 * t:]  # as the LSE in `probabilities`
        for j in range(NT):
            for e in range(2):
                dsum = delta_lane[8 * j + e]
                for mi in range(M):
                    for half in range(2):
                        x = mi * NT + j
                        dp[x, 2 * half + e] = s[x, 2 * half + e] * (dp[x, 2 * half + e] - dsum)
                        if MODIFIED:
                            dp[x, 2 * half + e] *= dlogit[x, 2 * half + e]

    return probabilities, ds


def _transposed_probabilities(M, NT, mods, TESTED, FUSED, BITS):
    """`transposed_steps`' P^T loop; ``TESTED``: each score passes the causal/window range (unless ``full``) and
    the user's checks, or with ``BITS`` the block mask's verdict on it from the tile's bits at ``slot`` (which
    hold the causal/window mask and the sequences' ends: `block_sparsity.BlockMask.query_tiles`), else every
    score is taken as visible; ``FUSED``: dP^T becomes dS^T in the same loop."""
    M_ROWS = 2 * M
    modifier = modifiers(mods, types.float32, fast=True)
    MODIFIED, logit2, visible = modifier.modified, modifier.logit2, modifier.visible
    GUARDED = guarded(mods)
    # A score_mod without a mask_mod, on a tile the mask crosses: called on every score without a branch, at the
    # indices of a visible pair (`masks.visible_pair`: the column's row, or the last, and the key of its range
    # nearest the score's), its result kept where the score is visible. Called inside a branch per score, it left
    # the loop rolled, S^T and dP^T in 256 bytes of local memory and the wgmma serialized (C7517; ptxas 13.0, v5 at
    # headdim 64 and 128, v3, the atomic dK/dV kernel), and a per-head temperature's backward ran 2.0x the plain
    # one at headdim 128 (1.15x without the branch; H100, .bench/sm_bwd.py). A mask_mod keeps the branch: a pair
    # it hides may index the user's tables out of their bounds.
    CLAMPED = TESTED and not BITS and mods.score_mod is not None and mods.mask_mod is None
    verdict_word = key_tiles.verdict_word(mods)

    @device_function
    def loop(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, full, g, t, seqlen_q, seqlen_k, left, right,
             scale_log2, b, h, bh, block_full, mod, slot, key_start):
        # ALiBi's distance of the lane's first query and its row-g key of the warp's first m-tile
        distance = types.float32(q_start + c0 + 2 * t + seqlen_k - seqlen_q - warp_key - g)
        # Untested tiles read the LSE at an unsigned index: a signed one pays Numba's negative-index wraparound
        # per load (six integer instructions). Tested ones keep the signed index: there the unsigned one (or a
        # view of `stats` from the lane's column) kept 12 bytes in local memory at headdim 128 (ptxas 13.0).
        lse_lane = types.uint64(lse_at + c0 + 2 * t)
        for j in range(NT):
            for e in range(2):
                col = c0 + 8 * j + 2 * t + e
                row = q_start + col
                lse2 = stats[lse_at + col] if TESTED else stats[lse_lane + types.uint64(8 * j + e)]
                dsum = stats[delta_at + col] if FUSED else ZERO
                lo_q, hi_q = 0, seqlen_k  # a full tile (or one the bits decide): no bounds to compute
                if TESTED and not BITS and not full:
                    lo_q, hi_q = masks.key_range(row, seqlen_q, seqlen_k, left, right)
                row_v, lo_v, hi_v = masks.visible_pair(row, seqlen_q, seqlen_k, left, right) if CLAMPED else (row, 0, 1)
                for r in range(M_ROWS):
                    mi, half = r // 2, r % 2
                    key = warp_key + lane_row(r, g)
                    p, grad = ZERO, ZERO
                    if BITS:
                        seen = key_tiles.shown(verdict_word(mod, slot, key - key_start, c0 + 8 * j, t), c0 + 8 * j, e)
                    else:
                        seen = not TESTED or (key >= lo_q and key < hi_q and (not GUARDED or (row < seqlen_q and (
                            block_full or visible(b, h, row, key, bh)))))
                    if CLAMPED:
                        x, grad = logit2(s[mi * NT + j, 2 * half + e], scale_log2, b, h, row_v,
                                         min(max(key, lo_v), hi_v - 1),
                                         abs(distance + types.float32(8 * j + e - lane_row(r, 0))), bh)
                        p = ex2(x - lse2) if seen else ZERO
                        grad = grad if seen else ZERO
                    elif seen:
                        x, grad = logit2(s[mi * NT + j, 2 * half + e], scale_log2, b, h, row, key,
                                         abs(distance + types.float32(8 * j + e - lane_row(r, 0))), bh)
                        p = ex2(x - lse2)
                    s[mi * NT + j, 2 * half + e] = p
                    if FUSED:
                        dp[mi * NT + j, 2 * half + e] = p * (dp[mi * NT + j, 2 * half + e] - dsum) * grad
                    elif MODIFIED:
                        dlogit[mi * NT + j, 2 * half + e] = grad

    return loop


@device_function
def staged_statistics(lse, stats, b, h, row):
    """`simt.backward.row_statistics` from a staged preprocess's ``stats`` (`build_staged_preprocess`), where
    the base-2 LSE and D of every row of a whole tile are stored (``lse`` unread)."""
    return stats[b, h, 0, row], stats[b, h, 1, row]


def row_steps(M, NT, mods=NONE, staged=False):
    """``(rows, ds)`` for row tiles of ``M`` m-tiles of 16 query rows and ``8 NT`` key columns; ``staged``: the
    kernel's ``delta`` is a staged preprocess's ``stats`` (`staged_statistics`)."""
    M_ROWS = 2 * M
    untested = untested_tile(mods)
    statistics = staged_statistics if staged else row_statistics(types.float32)
    checked, unchecked = (_row_ds(M, NT, mods, tested) for tested in (True, False))
    # ALiBi alone on a tile on one side of the warp's diagonal (`alibi_side`); the user's mask_mod keeps the tests
    ALIBI = mods.alibi_alone and not guarded(mods)
    sided = _alibi_rows(M, NT, mods)

    @device_function
    def rows(lse2, dsum, lo_r, hi_r, lse, delta, b, h, warp_row, g, seqlen_q, seqlen_k, left, right):
        # Entry r: row `fragments.lane_row(r, g)` of the warp's 16 M.
        for r in range(M_ROWS):
            row = warp_row + lane_row(r, g)
            lse2[r], dsum[r] = statistics(lse, delta, b, h, row)
            lo_r[r], hi_r[r] = masks.key_range(row, seqlen_q, seqlen_k, left, right)

    @device_function
    def ds(s, dp, lse2, dsum, lo_r, hi_r, full, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, b, h, bh,
           block_full, mod, slot, row_start, c0):
        if untested(full, block_full, warp_row + 16 * M, seqlen_q):
            side = (alibi_side(warp_row, warp_row + 16 * M, n_start, n_start + 8 * NT, seqlen_q - seqlen_k) if ALIBI
                    else 0)
            if side != 0:
                sided(s, dp, lse2, dsum, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, bh, side)
            else:
                unchecked(s, dp, lse2, dsum, lo_r, hi_r, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, b, h,
                          bh, block_full, mod, slot, row_start, c0)
        else:
            checked(s, dp, lse2, dsum, lo_r, hi_r, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, b, h, bh,
                    block_full, mod, slot, row_start, c0)

    return rows, ds


def _alibi_transposed(M, NT, mods, FUSED):
    """`transposed_steps`' P^T loop for ALiBi alone on a tile on one ``side`` of the warp's diagonal
    (`alibi_side`): the bias of key row ``r`` and query column ``c`` is ``slope side (r - Q_c)`` with ``Q_c``
    the column's distance from the warp's first key, kept with the column's LSE."""
    M_ROWS = 2 * M
    slope_of = modifiers(mods, types.float32, fast=True).slope
    ONE = types.float32(1)

    @device_function
    def loop(s, dp, dlogit, stats, lse_at, delta_at, q_start, c0, warp_key, side, g, t, seqlen_q, seqlen_k, scale, bh):
        slope2, scale2 = slope_of(bh) * LOG2E * types.float32(side), scale * LOG2E
        first = types.float32(q_start + c0 + 2 * t + seqlen_k - seqlen_q - warp_key)  # the lane's first Q_c
        lse_lane = types.uint64(lse_at + c0 + 2 * t)  # unsigned: `_transposed_probabilities`' reason
        for j in range(NT):
            for e in range(2):
                column = slope2 * (first + types.float32(8 * j + e)) + stats[lse_lane + types.uint64(8 * j + e)]
                dsum = stats[delta_at + c0 + 8 * j + 2 * t + e] if FUSED else ZERO
                for r in range(M_ROWS):
                    x, at = (r // 2) * NT + j, 2 * (r % 2) + e
                    p = ex2(s[x, at] * scale2 + (slope2 * types.float32(lane_row(r, g)) - column))
                    s[x, at] = p
                    if FUSED:
                        dp[x, at] = p * (dp[x, at] - dsum)
                    else:
                        dlogit[x, at] = ONE

    return loop


def _alibi_rows(M, NT, mods):
    """`row_steps`' dS loop for ALiBi alone on a tile on one ``side`` of the warp's diagonal (`alibi_side`): the
    bias of row ``r`` and key column ``c`` is ``slope side (R_r - c)`` with ``R_r`` the row's distance from the
    lane's first key, kept with the row's LSE.

    This loop and `_alibi_transposed` pay an FFMA a score for the term the LSE does not hold. The forward's column
    term from one more tensor-core k-step (`wgmma.alibi_columns`) would save it, but a stand-in with that k-step in
    both passes ran ALiBi's backward 1.18x the plain one at headdim 64, against 1.12-1.13x as built and 1.07-1.09x
    without the FFMA (H100, fp16, N = 16384, .bench/alibi_bwd.py)."""
    M_ROWS = 2 * M
    slope_of = modifiers(mods, types.float32, fast=True).slope

    @device_function
    def loop(s, dp, lse2, dsum, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale, bh, side):
        slope2, scale2 = slope_of(bh) * LOG2E * types.float32(side), scale * LOG2E
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            row = slope2 * types.float32(warp_row + lane_row(r, g) + seqlen_k - seqlen_q - n_start - 2 * t) - lse2[r]
            for j in range(NT):
                for e in range(2):
                    x = mi * NT + j
                    dp[x, 2 * half + e] = (ex2(s[x, 2 * half + e] * scale2 + (row - slope2 * types.float32(8 * j + e)))
                                           * (dp[x, 2 * half + e] - dsum[r]))

    return loop


def _row_ds(M, NT, mods, TESTED):
    """`row_steps`' dS loop; ``TESTED``: each score passes its row's key range and the user's checks, else every
    score is taken as visible."""
    M_ROWS = 2 * M
    modifier = modifiers(mods, types.float32, fast=True)
    logit2, visible = modifier.logit2, modifier.visible
    GUARDED = guarded(mods)
    BITS = TESTED and mods.block_sparse  # the block mask's verdicts on partial tiles, in place of visible()
    verdict_word = key_tiles.verdict_word(mods)

    @device_function
    def loop(s, dp, lse2, dsum, lo_r, hi_r, warp_row, n_start, g, t, seqlen_q, seqlen_k, scale_log2, b, h, bh,
             block_full, mod, slot, row_start, c0):
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            row = warp_row + lane_row(r, g)
            distance = types.float32(row + seqlen_k - seqlen_q - n_start - 2 * t)  # ALiBi's, first key
            for j in range(NT):
                word = types.int32(0)  # the row's verdicts on the lane's tile columns c0 + 8 j + 2 t + e
                if BITS and not block_full:
                    word = verdict_word(mod, slot, row - row_start, c0 + 8 * j, t)
                for e in range(2):
                    key = n_start + 8 * j + 2 * t + e
                    x = mi * NT + j
                    d = ZERO
                    if not TESTED:
                        seen = True
                    elif BITS and not block_full:  # the bits hold the causal/window mask and the sequences' ends
                        seen = key_tiles.shown(word, c0 + 8 * j, e)
                    else:
                        seen = key >= lo_r[r] and key < hi_r[r] and (not GUARDED or (
                            row < seqlen_q and (block_full or visible(b, h, row, key, bh))))
                    if seen:
                        x2, grad = logit2(s[x, 2 * half + e], scale_log2, b, h, row, key,
                                          abs(distance - types.float32(8 * j + e)), bh)
                        d = ex2(x2 - lse2[r]) * (dp[x, 2 * half + e] - dsum[r]) * grad
                    dp[x, 2 * half + e] = d

    return loop


def stats_stager(ROWS, THREADS):
    """``(load, store, per_thread)`` for the LSE and D of ``ROWS`` query rows, shared by ``THREADS`` threads:
    ``load(regs, lse, delta, b, h, q0, tid)`` puts this thread's entries (tid, tid + THREADS, .. of LSE of
    rows q0 .. q0 + ROWS - 1, then their D) in ``regs`` (``per_thread`` of them); ``store(stats, at, regs,
    tid)`` writes them from ``at`` on."""
    STATS = 2 * ROWS
    PER_THREAD = -(-STATS // THREADS)
    statistics = row_statistics(types.float32)

    @device_function
    def load(regs, lse, delta, b, h, q0, tid):
        for j in range(PER_THREAD):
            i = tid + j * THREADS
            if i < STATS:
                lse2, dsum = statistics(lse, delta, b, h, q0 + i % ROWS)
                regs[j] = lse2 if i < ROWS else dsum

    @device_function
    def store(stats, at, regs, tid):
        for j in range(PER_THREAD):
            if tid + j * THREADS < STATS:
                stats[at + tid + j * THREADS] = regs[j]

    return load, store, PER_THREAD
