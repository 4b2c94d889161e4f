"""What a forward kernel's block writes for query rows whose every key the mask hides.

Such rows have no softmax: by flash-attn's convention their output is 0 and their LSE -inf. A block
whose rows all see no key writes that and loads nothing; both forward kernels call this one function.
"""

import math

from .intrinsics import device_function


@device_function
def write_hidden_rows(out, lse, b, h, row_start, row_end, zero, tid, threads):
    """``out[b, row_start:row_end, h, :] = zero`` and ``lse[b, h, row_start:row_end] = -inf``, by the block's
    ``threads`` threads together (consecutive threads write consecutive head-dim elements)."""
    headdim = out.shape[3]
    for e in range(tid, (row_end - row_start) * headdim, threads):
        i = e // headdim
        out[b, row_start + i, h, e - i * headdim] = zero
        if e - i * headdim == 0:
            lse[b, h, row_start + i] = -math.inf
