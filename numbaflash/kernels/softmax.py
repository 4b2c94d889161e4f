"""The online softmax on tensor-core score fragments: the named steps of a forward kernel's loop.

A warp's score tile sits in registers as the accumulator fragments of mma.sync (and of wgmma, which
gives each warp of a warpgroup the same layout for its 16 rows): lane ``4 g + t`` holds, for each of
its ``M`` m-tiles, rows ``g`` and ``g + 8`` (`fragments.lane_row`) and in every 8-column chunk ``j`` the
columns ``8 j + 2 t`` and ``+ 1``, so a row's scores are spread over the 4 lanes of a quad. Fragment
row ``r`` (0 .. 2 M - 1) of a lane is m-tile ``r // 2``, half ``r % 2``; ``s[mi * NT + j, 2 half + e]``.

The steps, in the order a key tile goes through them (`sim.online_softmax` is the same algorithm on
whole arrays), after ``start(acc, m_i, l_i)``, which sets a block's output to 0, its running maxima to
-inf and its sums to 0:

* ``mask(s, shift, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left, right, scale, bh,
  block_full, mod, slot)``: hidden scores become -inf (only a tile the causal/window edge or the sequence's
  end crosses pays for it, and, with a mask_mod, a tile the block mask did not find full: ``block_full``;
  with a block mask, a row reads its verdicts on such a tile from the mask's bits a word at a time, ``slot``
  from `key_tiles.verdict_slot`, instead of calling mask_mod per score).
  With softcap, ALiBi or a score_mod (`kernels.mods`) visible scores become their modified natural-log
  scores ``logit(scale * s)`` (without a branch per score on a tile the mask leaves whole), and the steps
  after it take log2(e) as their scale. With ALiBi alone every tile is modified (whole or not) and sets
  ``shift`` (``(2 M, 2)``, by fragment row and column parity): on a tile wholly on one side of a warp's
  diagonal each score's row term, kept apart from it; 0 on a tile the diagonal crosses. With ``alibi_columns``
  (v5, whose tensor cores add a one-sided tile's column term: `wgmma.alibi_columns`) the scores stay in units of
  softmax_scale (`kernels.mods.alibi_columns_units`), the side is the warpgroup's, and ``shift[:, 0]`` holds
  each row's term: a one-sided tile's scores take no instruction here.
* ``online_softmax(s, shift, m_i, l_i, alpha, scale_log2)``: new running maxima ``m_i``, the factor ``alpha`` by
  which earlier sums and outputs shrink, ``s`` exponentiated in place (``P``), and the running sums ``l_i`` (a
  lane's partial sum; the quad adds them at the end), unless the tensor cores sum P (``row_sums``). A row's
  maximum moves only where the tile's exceeds it by more than ``RESCALE_LOG2`` (base 2;
  `sim.online_softmax.update`'s ``threshold``), else its ``alpha`` is 1 and P reaches up to 2^8. Each lane tests
  its own scores against that first, and a warp none of whose lanes sees a move (``warp_any``) skips the quad's
  reduction, two shuffles a row: the plain v5 forward ran 2-6% faster at headdim 64 and 4-7% at 128 (H100, fp16 and
  bf16, N = 16384, three paired runs, .bench/vote_ab.py). With ``bounded_max`` (softcap alone: its bound, less
  ``RESCALE_LOG2``, is every row's maximum, `tiling.fixed_maximum`) no maximum is formed. Scores stay raw:
  ``softmax_scale * log2(e)`` is folded into the exponent's FMA, and the exponential is the hardware's ex2 (in
  ``fma_chunks`` of each row's 8-key chunks a polynomial on the FMA pipe, `ex2_fma`, where the special-function
  unit is what bounds the kernel: softcap's tanh at headdim 64, `tiling.WGMMA_SOFTCAP_TILES`; with the tensor
  cores' row sums and float16 P those chunks keep their exponents, and P's packing takes their exponentials two at
  a time as float16 pairs, ``fma_pairs``). A scale <= 0
  (flash-attn takes any) first turns the visible raw scores: a negative one makes the largest scaled score the
  smallest raw one, so they are negated and the step works with the scale's magnitude (``m_i`` holds maxima of
  ``-s``); zero makes them all 0, with scale 1 (`effective_scale`). A uniform branch: a positive scale pays one
  comparison per tile.
* ``rescale_o(acc, alpha)``: the output accumulators (with ``row_sums``, the sums' too) times ``alpha``, row by
  row, behind a branch that a warp whose rows all kept their maxima skips (most tiles after the first few): the
  plain v5 forward ran 2-6% faster at headdim 64 and within 2% either way at 128, softcap's 3% faster at 128
  (H100, N = 4096 and 16384, .bench/rescale_ab.py).
* ``finish(acc, l_i, inv)``: each row's whole sum (over the quad, or the tensor cores' from ``acc``) into ``l_i``
  and its inverse (0 for a row that saw no key, whose sum is exactly 0) into ``inv``, for the one normalization at
  the end. A NaN score makes the sum NaN, and out and LSE NaN with it, as in the reference.
* ``write_lse(lse, b, h, warp_row, g, t, m_i, l_i, scale_log2)``: each row's log-sum-exp (natural log; -inf
  for a row that saw no key), written once by the quad's first lane.
"""

import math


import numpy as np
from numba import types

from .. import masks
from ..mods import NONE
from .intrinsics import device_function, ex2, ex2_fma, group_max, group_sum, tanh_approx, warp_any
from . import key_tiles
from .fragments import fill, lane_row
from .mods import alibi_columns_offset, alibi_columns_side, alibi_columns_units, alibi_side, modifiers

ZERO, ONE, NEG_INF, LN2 = np.float32(0), np.float32(1), np.float32(-np.inf), np.float32(math.log(2.0))
LOG2E = np.float32(math.log2(math.e))
# A row's running maximum moves only when a tile's exceeds it by more than this (base 2), so most tiles leave the
# output unscaled (FlashAttention-4's conditional rescaling): P stays at most 2^8, well inside float16's range,
# and m_i, l_i and the output keep one reference point, so the result is the same softmax.
RESCALE_LOG2 = np.float32(8)


@device_function
def effective_scale(scale_log2):
    """The scale `online_softmax` works with once it has turned the raw scores: |scale| for a negative one
    (the scores negated), 1 for zero (every visible score 0: -inf x 0 would make hidden ones NaN)."""
    return abs(scale_log2) if scale_log2 != ZERO else ONE


@device_function
def fma_chunk(j, NT, fma_chunks):
    """Whether 8-key chunk ``j`` of ``NT`` takes its exponentials from `ex2_fma`: ``fma_chunks`` of them, spread
    evenly over the tile."""
    return (j + 1) * fma_chunks // NT > j * fma_chunks // NT


def steps(M, NT, DT, mods=NONE, fma_chunks=0, alibi_columns=False, row_sums=False, bounded_max=False,
          fma_pairs=False):
    """``(start, mask, online_softmax, rescale_o, finish, write_lse)`` for ``M`` m-tiles of ``8 NT`` keys and ``8 DT``
    output columns, with the modifications ``mods`` (`numbaflash.mods.Mods`); ``fma_chunks`` of each row's ``NT``
    8-key chunks take their exponentials from `ex2_fma` on the FMA pipe, the rest from ex2. ``alibi_columns``: the
    kernel's tensor cores add ALiBi alone's column term to the scores of tiles on one side of a warpgroup's
    diagonal (`wgmma.alibi_columns`), which then stay in the units of `kernels.mods.alibi_columns_units`.
    ``row_sums`` (one m-tile): the kernel's tensor cores sum each row's P into 8 more output columns, the
    accumulators' row block ``DT`` (`wgmma.row_sums`), which the steps scale with O and take l from.
    ``bounded_max`` (softcap alone; other modifications ignore it): softcap's bound, less ``RESCALE_LOG2``, is every
    row's maximum (`tiling.fixed_maximum` says where that holds). ``fma_pairs`` (with ``row_sums``, float16 P):
    ``online_softmax`` leaves the ``fma_chunks``' scores as their base-2 exponents, whose exponentials P's packing
    takes two at a time as float16 pairs (`ex2_fma_f16x2`, `wgmma.tiles.pack_p`)."""
    M_ROWS = 2 * M
    if row_sums and M != 1:
        raise ValueError(f"row sums from the tensor cores are a warpgroup's, one m-tile a warp; got {M} m-tiles")
    if fma_pairs and not row_sums:
        raise ValueError("float16 pairs of exponentials (fma_pairs) leave no float32 P to sum: they need row_sums")
    SUMS = int(row_sums)  # accumulator row blocks after O's
    modifier = modifiers(mods, types.float32, fast=True)
    MODIFIED, MASKED, logit, visible = modifier.modified, modifier.masked, modifier.logit, modifier.visible
    cap_of, slope_of = modifier.cap, modifier.slope
    USER_SCORES = mods.score_mod is not None
    # softcap alone keeps its scores as tanh(scale s / cap) and the softmax's scale takes the cap: two
    # multiplications per score fewer (its forward at headdim 128 ran 3% faster, H200)
    CAPPED = mods.softcap_alone
    BOUNDED = CAPPED and bounded_max  # softcap's scores below their bound: a fixed maximum, no row maxima
    ALIBI_ALONE = mods.alibi_alone  # its tiles on one side of a warp's diagonal: `kernels.mods.alibi_side`
    COLUMNS = ALIBI_ALONE and alibi_columns  # one side of a warpgroup's diagonal: columns from the tensor cores
    PARITY_SHIFT = ALIBI_ALONE and not COLUMNS  # a row term per column parity (`modify`); one per row with COLUMNS
    BITS = mods.block_sparse  # a block mask keeps the mask_mod's verdicts on partial tiles as bits
    verdict_word = key_tiles.verdict_word(mods)

    @device_function
    def logit_scale(scale, bh):
        """The scale the softmax multiplies scores by: the kernel's softmax_scale * log2(e), or log2(e) for the
        natural-log scores `mask` leaves with modifications (cap * log2(e) for softcap's tanh alone)."""
        if CAPPED:
            return cap_of(bh)[0] * LOG2E
        if COLUMNS:
            return alibi_columns_units(scale, slope_of(bh))[0] * LOG2E
        return LOG2E if MODIFIED else scale

    @device_function
    def start(acc, m_i, l_i):
        fill(acc, M * DT + SUMS, 4, ZERO)
        for r in range(M_ROWS):
            m_i[r] = NEG_INF
            l_i[r] = ZERO

    @device_function
    def bias_scores(s, rows, g, t, sigma, gamma):
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            distance = rows + types.float32(lane_row(r, g) - 2 * t)  # the lane's first key's
            for j in range(NT):
                for e in range(2):
                    x = s[mi * NT + j, 2 * half + e]
                    s[mi * NT + j, 2 * half + e] = x * sigma - gamma * abs(distance - types.float32(8 * j + e))

    @device_function
    def modify_columns(s, shift, warp_row, row_start, g, t, n_start, seqlen_q, seqlen_k, scale, bh):
        # ALiBi alone with the column term from the tensor cores: scores x / units (`alibi_columns_units`)
        _, gamma, ok = alibi_columns_units(scale, slope_of(bh))
        offset = alibi_columns_offset(warp_row, n_start, seqlen_q, seqlen_k)
        side = alibi_columns_side(offset + types.float32((warp_row - row_start) & 63), 8 * NT)  # the warpgroup's
        if not ok:  # the column operands hold zeros: every tile's bias per score, in natural units
            side = 0
        rows = -offset  # the warp's first row's distance from the tile's first key
        if side != 0:
            # the tensor cores added -gamma side c to column c's scores; the row term gamma side (row + seqlen_k -
            # seqlen_q - n_start) joins the row's maxima and exponents
            for r in range(M_ROWS):
                shift[r, 0] = gamma * types.float32(side) * (rows + types.float32(lane_row(r, g)))
            return
        # a tile across the diagonal: each score's bias, in units of scale (else natural ones)
        for r in range(M_ROWS):
            shift[r, 0] = ZERO
        bias_scores(s, rows, g, t, ONE if ok else scale, gamma)

    @device_function
    def modify(s, shift, b, h, warp_row, row_start, g, t, n_start, seqlen_q, seqlen_k, scale, bh):
        # Every score modified, without a branch per score: each index in bounds, or no user function reads it.
        if COLUMNS:
            modify_columns(s, shift, warp_row, row_start, g, t, n_start, seqlen_q, seqlen_k, scale, bh)
            return
        if CAPPED:
            capped = scale * cap_of(bh)[1]
            for j in range(M * NT):
                for e in range(4):
                    s[j, e] = tanh_approx(s[j, e] * capped)
            return
        if ALIBI_ALONE:
            # distance D = key - (row + seqlen_k - seqlen_q); on a side s != 0 the bias -slope |D| is
            # slope s (R - c) with R the row's distance from the lane's first key and c = 8 j + e the column's
            # from it: the scores keep -slope s 8 j, and `shift` the rest, slope s (R - e) by row and parity,
            # which the softmax adds to their maxima and exponents (one FFMA a score where the bias took two)
            side = alibi_side(warp_row, warp_row + 16 * M, n_start, n_start + 8 * NT, seqlen_q - seqlen_k)
            if side != 0:
                slope = slope_of(bh) * types.float32(side)
                for r in range(M_ROWS):
                    distance = types.float32(warp_row + lane_row(r, g) + seqlen_k - seqlen_q - n_start - 2 * t)
                    for e in range(2):
                        shift[r, e] = slope * (distance - types.float32(e))
                for j in range(M * NT):
                    column = slope * types.float32(8 * (j % NT))
                    for e in range(4):
                        s[j, e] = s[j, e] * scale - column
                return
            fill(shift, M_ROWS, 2, ZERO)  # a tile the diagonal crosses: its scores below are whole
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            row = warp_row + lane_row(r, g)
            distance = types.float32(row + seqlen_k - seqlen_q - n_start - 2 * t)  # ALiBi's, for the lane's first key
            for j in range(NT):
                for e in range(2):
                    s[mi * NT + j, 2 * half + e] = logit(s[mi * NT + j, 2 * half + e] * scale, b, h, row,
                                                         n_start + 8 * j + 2 * t + e,
                                                         abs(distance - types.float32(8 * j + e)), bh)

    @device_function
    def mask(s, shift, b, h, warp_row, g, t, n_start, row_start, row_end, seqlen_q, seqlen_k, left, right, scale, bh,
             block_full, mod, slot):
        # A block mask's full tile: mask_mod, the causal/window mask and the sequences' ends all show it whole
        # (`BlockMask.unmasked`), so neither mask_mod nor the edge test runs on it.
        masked = MASKED and not block_full
        if not masked and (block_full or masks.tile_is_full(row_start, row_end, n_start, n_start + 8 * NT, seqlen_q,
                                                            seqlen_k, left, right)):
            if not USER_SCORES or warp_row + 16 * M <= seqlen_q:  # no user function sees a row past the sequence
                if MODIFIED:
                    modify(s, shift, b, h, warp_row, row_start, g, t, n_start, seqlen_q, seqlen_k, scale, bh)
                return
        # The built-in modifications read no memory: every score is modified, then the hidden ones are set to
        # -inf. Modified inside the tests below (a test per score), their code kept 140-308 bytes of local
        # memory in three consumers at headdim 64 (ptxas 13.0); the user's score_mod sees only visible scores.
        if MODIFIED and not USER_SCORES:
            modify(s, shift, b, h, warp_row, row_start, g, t, n_start, seqlen_q, seqlen_k, scale, bh)
        if BITS and masked:
            # The block mask's bits already hold the causal/window mask and the sequences' ends (a key range per
            # row beside them kept 48 bytes of local memory in three consumers at headdim 64).
            for r in range(M_ROWS):
                mi, half = r // 2, r % 2
                row = warp_row + lane_row(r, g)
                distance = types.float32(row + seqlen_k - seqlen_q - n_start - 2 * t)
                for j in range(NT):
                    word = verdict_word(mod, slot, row - row_start, 8 * j, t)
                    for e in range(2):
                        x = s[mi * NT + j, 2 * half + e]
                        if not key_tiles.shown(word, 8 * j, e):
                            x = NEG_INF
                        elif USER_SCORES:
                            x = logit(x * scale, b, h, row, n_start + 8 * j + 2 * t + e,
                                      abs(distance - types.float32(8 * j + e)), bh)
                        s[mi * NT + j, 2 * half + e] = x
            return
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            row = warp_row + lane_row(r, g)
            distance = types.float32(row + seqlen_k - seqlen_q - n_start - 2 * t)
            lo_r, hi_r = masks.key_range(row, seqlen_q, seqlen_k, left, right)
            if row >= seqlen_q:  # rows past the sequence never reach the user's functions
                hi_r = lo_r
            # The row's visible keys counted from the lane's first, clamped to the tile: each score's test compares
            # a constant with them (64-bit keys per score took registers three consumers lack).
            first = n_start + 2 * t
            lo_c = types.int32(min(max(lo_r - first, -1), 8 * NT))
            hi_c = types.int32(min(max(hi_r - first, -1), 8 * NT))
            for j in range(NT):
                for e in range(2):
                    key = n_start + 8 * j + 2 * t + e
                    x = s[mi * NT + j, 2 * half + e]
                    hidden = 8 * j + e < lo_c or 8 * j + e >= hi_c
                    if not hidden and masked and not BITS:  # with BITS, masked tiles took the branch above
                        hidden = not visible(b, h, row, key, bh)
                    if hidden:
                        x = NEG_INF
                    elif USER_SCORES:
                        x = logit(x * scale, b, h, row, key, abs(distance - types.float32(8 * j + e)), bh)
                    s[mi * NT + j, 2 * half + e] = x

    @device_function
    def online_softmax(s, shift, m_i, l_i, alpha, scale_log2, bh):
        scale_log2 = logit_scale(scale_log2, bh)
        if scale_log2 <= ZERO:  # uniform over the block: no cost to a positive scale but this test
            sign = -ONE if scale_log2 < ZERO else ZERO
            for j in range(M * NT):
                for e in range(4):
                    if s[j, e] != NEG_INF:  # hidden scores stay hidden (-inf x 0 would be NaN)
                        s[j, e] *= sign
            if COLUMNS:  # negative units: the row terms turn with the scores
                for r in range(M_ROWS):
                    shift[r, 0] *= sign
            scale_log2 = effective_scale(scale_log2)
        if not BOUNDED:
            new_maxima(s, shift, m_i, alpha, scale_log2)
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            even_base, odd_base = bases(shift, m_i, r, scale_log2)
            row_sum = ZERO
            for j in range(mi * NT, mi * NT + NT):
                on_fma = fma_chunk(j - mi * NT, NT, fma_chunks)
                for e in range(2):
                    x = s[j, 2 * half + e] * scale_log2 - (odd_base if e == 1 else even_base)
                    if fma_pairs and on_fma:
                        s[j, 2 * half + e] = x  # its exponential comes with P's word (`wgmma.tiles.pack_p`)
                        continue
                    p = ex2_fma(x) if on_fma else ex2(x)
                    s[j, 2 * half + e] = p
                    if not SUMS:
                        row_sum += p
            if not SUMS:
                l_i[r] = l_i[r] + row_sum if BOUNDED else l_i[r] * alpha[r] + row_sum

    @device_function
    def lane_max(s, shift, r):
        """The largest of row ``r``'s scores in this lane (with `shift`'s row terms)."""
        mi, half = r // 2, r % 2
        if PARITY_SHIFT:  # a row's scores of each column parity, plus that parity's `shift`
            even, odd = s[mi * NT, 2 * half], s[mi * NT, 2 * half + 1]
            for j in range(mi * NT, mi * NT + NT):
                even, odd = max(even, s[j, 2 * half]), max(odd, s[j, 2 * half + 1])
            return max(even + shift[r, 0], odd + shift[r, 1])
        row_max = s[mi * NT, 2 * half]
        for j in range(mi * NT, mi * NT + NT):
            row_max = max(row_max, max(s[j, 2 * half], s[j, 2 * half + 1]))
        return row_max + shift[r, 0] if COLUMNS else row_max

    @device_function
    def new_maxima(s, shift, m_i, alpha, scale_log2):
        # A row's maximum moves only past RESCALE_LOG2: +inf at a row's first visible key, NaN (no move) while it has
        # seen only hidden ones, whose m = -inf is exponentiated against 0. Each lane first tests its own scores, so
        # the quad's reduction (two shuffles a row) runs only in a warp some row of which moves: a row's tile maximum
        # is one lane's own, and that lane's test is the same comparison.
        moved = False
        for r in range(M_ROWS):
            alpha[r] = lane_max(s, shift, r)  # the lane's maximum until the quad's below
            moved = moved or (alpha[r] - m_i[r]) * scale_log2 > RESCALE_LOG2
        if not warp_any(moved):
            for r in range(M_ROWS):
                alpha[r] = ONE
            return
        for r in range(M_ROWS):
            m_tile = max(m_i[r], group_max(alpha[r], 4))
            if (m_tile - m_i[r]) * scale_log2 > RESCALE_LOG2:
                alpha[r] = ex2(m_i[r] * scale_log2 - m_tile * scale_log2)
                m_i[r] = m_tile
            else:
                alpha[r] = ONE

    @device_function
    def bases(shift, m_i, r, scale_log2):
        """The exponent's bases of row ``r``'s even and odd columns."""
        if BOUNDED:  # softcap's bound, less RESCALE_LOG2, for every row's maximum (`tiling.fixed_maximum`)
            return scale_log2 - RESCALE_LOG2, scale_log2 - RESCALE_LOG2
        base = m_i[r] * scale_log2 if m_i[r] != NEG_INF else ZERO
        if PARITY_SHIFT:
            return base - shift[r, 0] * scale_log2, base - shift[r, 1] * scale_log2
        if COLUMNS:
            return base - shift[r, 0] * scale_log2, base - shift[r, 0] * scale_log2
        return base, base

    @device_function
    def rescale_o(acc, alpha):
        if BOUNDED:  # the maxima never move
            return
        moved = False
        for r in range(M_ROWS):
            moved = moved or alpha[r] != ONE
        if not moved:  # a warp whose rows all kept their maxima skips it (a branch, not predicated multiplications)
            return
        for r in range(M_ROWS):
            mi, half = r // 2, r % 2
            for j in range(mi * DT, mi * DT + DT + SUMS):
                acc[j, 2 * half] *= alpha[r]
                acc[j, 2 * half + 1] *= alpha[r]

    @device_function
    def finish(acc, l_i, inv):
        for r in range(M_ROWS):
            # the tensor cores' sums are the whole row's in each lane (every column of P 1 is)
            l_i[r] = acc[DT, 2 * r] if SUMS else group_sum(l_i[r], 4)
            inv[r] = ONE / l_i[r] if l_i[r] != ZERO else ZERO

    @device_function
    def write_lse(lse, b, h, warp_row, g, t, m_i, l_i, scale_log2, bh):
        scale_log2 = logit_scale(scale_log2, bh)
        for r in range(M_ROWS):
            row = warp_row + lane_row(r, g)
            if row < lse.shape[2] and t == 0:
                m = scale_log2 - RESCALE_LOG2 if BOUNDED else m_i[r] * effective_scale(scale_log2)
                lse[b, h, row] = (m + math.log2(l_i[r])) * LN2 if l_i[r] != ZERO else NEG_INF

    return start, mask, online_softmax, rescale_o, finish, write_lse
