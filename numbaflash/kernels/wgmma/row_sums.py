"""The softmax's row sums from the tensor cores: P times a column of ones beside each P V (v5's forward).

The online softmax's running sum l_i adds each tile's exponentials, one FADD per score on the CUDA cores. The
tensor cores can add them instead: O's accumulators get 8 more columns, ``P [V | 1]``, one ``m64n8k16`` wgmma
per k-step of P V with B a 16 x 8 block of ones in shared memory, read by every k-step and tile. The sums are
then those of P as rounded to 16 bits, the weights P V multiplies, so out = O / l normalizes exactly the
weights it averages with; each lane holds its rows' whole sums (no quad reduction at the end), and the
rescaling by alpha that O takes, they take with it (`kernels.softmax`'s ``row_sums``).

Measured (H100, fp16, N = 16384, 16 heads, stream timing, three paired runs against the kernels without it,
``.bench/ab_run.sh cap_ab.py`` and ``alibi_ab.py``): softcap alone at headdim 64 1.40-1.42x -> 1.32-1.34x the
plain forward's time (causal 1.40-1.42x -> 1.33-1.35x), ALiBi alone 1.09-1.12x -> 1.08-1.10x (causal within
its spread). The plain forward at 64 ran the same with it, softcap and ALiBi at 128 4-6% slower (the 8 more
wgmma a tile). Accuracy against float64 (N = 1024, 16 heads, inputs 3 x standard normal, softcap 30,
``.bench/ahead_ab.py``): out's largest error 6.8e-3 -> 4.2e-3 (float16) and 5.2e-2 -> 3.4e-2 (bfloat16); the
LSE's 2.7e-4 -> 5.4e-4 and 2.7e-4 -> 3.5e-3, as the sum of rounded P differs from the float32 sum of P by up to
P's rounding: outside flash-attn's rule where logits are small. So `tiling` plans it for softcap alone and ALiBi
alone at headdim 64 where the caller takes no LSE (`tiling.ROW_SUMS_HEADDIMS`).
"""

import numpy as np

from ..intrinsics import device_function, wgmma_rs
from .tiles import ATOM, operand

ROWS = 16  # B's rows: one k-step of keys
ONE = {"float16": 0x3C00, "bfloat16": 0x3F80}  # 1.0's bits


def elements():
    """16-bit elements of B in shared memory: 16 rows of a swizzle atom (every element 1; wgmma reads the
    first 8 columns, wherever the swizzle puts them)."""
    return ROWS * ATOM


def row_sums(D, BLOCK_N, storage):
    """``(fill, descriptor, add)`` for tiles of ``BLOCK_N`` keys, output columns ``D`` (the sums sit in the
    accumulators' row block ``D / 8``, after O's):

    * ``fill(words, at, tid, threads)``: the block's threads write B's ones at 16-bit element ``at`` of shared
      memory through ``words``, the same memory as 8-byte words; the caller fences them for the async proxy
      before a barrier;
    * ``descriptor(address, at)``: B's MN-major descriptor, at element ``at`` past shared ``address`` (bytes);
    * ``add(acc, p, smem, desc)``: ``acc``'s sums += P 1 over P's ``BLOCK_N / 16`` k-steps (P's A words ``p``, as
      `tiles.products`' ``accumulate`` takes them), issued with P V in its commit group."""
    word = np.uint64(ONE[storage] * 0x0001000100010001)
    sums = wgmma_rs(8, storage, first=D // 2)
    PS = BLOCK_N // 16

    @device_function
    def fill(words, at, tid, threads):
        for e in range(tid, ROWS * ATOM // 4, threads):
            words[at // 4 + e] = word

    @device_function
    def descriptor(address, at):
        return operand(address, at, ROWS, True)

    @device_function
    def add(acc, p, smem, desc):
        for ks in range(PS):
            sums(acc, p[ks, 0], p[ks, 1], p[ks, 2], p[ks, 3], smem, desc)

    return fill, descriptor, add
