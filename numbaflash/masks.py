"""Which keys a query row may see: the one definition of the causal and sliding-window masks.

The float64 reference, the IO simulator `sim` and the CUDA kernels all call these functions (the kernels
compile them as device functions), so the three agree on every edge case by construction.

Alignment follows flash-attn >= 2.1: the mask is aligned to the bottom-right corner of the
(seqlen_q, seqlen_k) score matrix, so query row ``i`` sits at key position ``i + seqlen_k - seqlen_q``.
A window ``(left, right)`` lets that row see keys ``[pos - left, pos + right]``; -1 means unbounded on
that side, and ``causal`` is the window ``(left, 0)``.
"""


def normalize_window(causal, window_size):
    """Return ``(left, right)`` with -1 for an unbounded side; ``causal`` forces ``right = 0``.

    flash-attn's convention: ``causal=True`` with ``window_size=(w, -1)`` is the window ``(w, 0)``.
    """
    left, right = window_size
    if causal:
        right = 0
    return left, right


def key_range(row, seqlen_q, seqlen_k, left, right):
    """Half-open range ``[lo, hi)`` of keys visible to query ``row``; empty when ``lo >= hi``.

    Both ends are non-decreasing in ``row``, which is what makes a block of rows see one
    contiguous range of keys (see `block_key_range`).
    """
    pos = row + seqlen_k - seqlen_q
    lo = 0
    if left >= 0 and pos - left > 0:
        lo = pos - left
    hi = seqlen_k
    if right >= 0 and pos + right + 1 < seqlen_k:
        hi = pos + right + 1
    return lo, hi


def block_key_range(row_start, row_end, seqlen_q, seqlen_k, left, right):
    """Keys visible to at least one row of ``[row_start, row_end)``, as one half-open range.

    The union of the rows' ranges has no gap: ends grow with the row, consecutive non-empty rows
    overlap or touch because ``left + right >= 0``, and leading empty rows (bottom-right causal
    with seqlen_q > seqlen_k) start at key 0 like the first row that sees anything. So a key tile
    that meets this range holds at least one visible score, and one that misses it is hidden.
    """
    lo, _ = key_range(row_start, seqlen_q, seqlen_k, left, right)
    _, hi = key_range(row_end - 1, seqlen_q, seqlen_k, left, right)
    return lo, hi


def tile_is_full(row_start, row_end, col_start, col_end, seqlen_q, seqlen_k, left, right):
    """True when every row of the block sees every key of ``[col_start, col_end)``: no mask needed."""
    lo_last, _ = key_range(row_end - 1, seqlen_q, seqlen_k, left, right)
    _, hi_first = key_range(row_start, seqlen_q, seqlen_k, left, right)
    return col_start >= lo_last and col_end <= hi_first


def query_range(col_start, col_end, seqlen_q, seqlen_k, left, right):
    """Rows ``[lo, hi)`` that see at least one key of ``[col_start, col_end)``: the inverse of `key_range`.

    Row i sees key j iff ``pos - left <= j <= pos + right`` with ``pos = i + seqlen_k - seqlen_q`` (a side
    of -1 unbounded). Some key of the block is seen iff ``pos + right >= col_start`` and
    ``pos - left < col_end``; every row in between is non-empty, because with ``left, right >= 0``
    a row can only be empty when its range is clipped away entirely at 0 or at seqlen_k.
    """
    offset = seqlen_k - seqlen_q
    lo = 0
    if right >= 0 and col_start - right - offset > 0:
        lo = col_start - right - offset
    hi = seqlen_q
    if left >= 0 and col_end + left - offset < seqlen_q:
        hi = col_end + left - offset
    return lo, hi


def visible_pair(row, seqlen_q, seqlen_k, left, right):
    """``(row_v, lo, hi)``: a query row that sees at least one key, and its keys ``[lo, hi)`` (non-empty).

    ``row`` itself where it lies in the sequence and sees a key, else the last row, which sees key
    ``seqlen_k - 1`` under every window (``left, right >= 0`` or unbounded); needs seqlen_q, seqlen_k >= 1.
    Kernels that call the user's functions on every score of a tile without a branch pass them ``row_v`` and
    a key clamped into ``[lo, hi)``, a visible pair, and keep the result only where the score is visible.
    """
    row_v = min(row, seqlen_q - 1)
    lo, hi = key_range(row_v, seqlen_q, seqlen_k, left, right)
    if lo >= hi:
        row_v = seqlen_q - 1
        lo, hi = key_range(row_v, seqlen_q, seqlen_k, left, right)
    return row_v, lo, hi
