"""Block-level mask helpers against the row-level truth they summarize."""

import numpy as np
from hypothesis import given, settings, strategies as st

from numbaflash import masks, reference

sizes = st.integers(1, 40)
sides = st.integers(-1, 12)


@settings(max_examples=200)
@given(nq=sizes, nk=sizes, causal=st.booleans(), left=sides, right=sides,
       block=st.integers(1, 16), bcols=st.integers(1, 16))
def test_block_range_visits_exactly_the_tiles_with_a_visible_score(nq, nk, causal, left, right, block, bcols):
    mask = reference.visible_mask(nq, nk, causal, (left, right))
    l, r = masks.normalize_window(causal, (left, right))
    for r0 in range(0, nq, block):
        r1 = min(r0 + block, nq)
        lo, hi = masks.block_key_range(r0, r1, nq, nk, l, r)
        for c0 in range(0, nk, bcols):
            c1 = min(c0 + bcols, nk)
            assert (max(lo, c0) < min(hi, c1)) == bool(mask[r0:r1, c0:c1].any())
            assert masks.tile_is_full(r0, r1, c0, c1, nq, nk, l, r) == bool(mask[r0:r1, c0:c1].all())


@settings(max_examples=200)
@given(nq=sizes, nk=sizes, causal=st.booleans(), left=sides, right=sides, bcols=st.integers(1, 16))
def test_query_range_is_exactly_the_rows_that_see_a_key_block(nq, nk, causal, left, right, bcols):
    mask = reference.visible_mask(nq, nk, causal, (left, right))
    l, r = masks.normalize_window(causal, (left, right))
    for c0 in range(0, nk, bcols):
        c1 = min(c0 + bcols, nk)
        lo, hi = masks.query_range(c0, c1, nq, nk, l, r)
        sees = mask[:, c0:c1].any(axis=1)
        assert list(np.flatnonzero(sees)) == list(range(max(lo, 0), min(hi, nq)))


@settings(max_examples=200)
@given(nq=sizes, nk=sizes, causal=st.booleans(), left=sides, right=sides)
def test_visible_pair_gives_every_row_a_visible_pair_and_keeps_its_own_where_it_sees_a_key(nq, nk, causal, left, right):
    mask = reference.visible_mask(nq, nk, causal, (left, right))
    l, r = masks.normalize_window(causal, (left, right))
    for row in range(nq + 3):  # rows past the sequence too, as a tile's last rows
        row_v, lo, hi = masks.visible_pair(row, nq, nk, l, r)
        assert 0 <= row_v < nq and lo < hi
        assert row_v == row if row < nq and mask[row].any() else row_v == nq - 1
        for key in range(-2, nk + 3):
            assert mask[row_v, min(max(key, lo), hi - 1)], (row, key, row_v, lo, hi)
