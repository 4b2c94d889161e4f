"""Where a thread block's sequence lies in its operands: the whole batch element, or one packed sequence.

A varlen call (`numbaflash.varlen`) packs its sequences along one axis, flash-attn's layout: q is
``(total_q, nheads, headdim)`` and sequence ``b`` holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. The
kernels receive every operand as a 4-D view whose batch axis has stride 0 (each batch index sees the
whole packed array) and, in their ``mod`` tuple (`kernels.mods`), ``cu_seqlens_q`` and ``cu_seqlens_k``.
At its start a block of a kernel built with ``mods.packed`` narrows its operands to its own sequence::

    if PACKED:
        q_start, q_end, k_start, k_end = sequence(mod, cuda.blockIdx.z)
        q = q[:, q_start:q_end]  # and out, dq, dout; lse and delta on their last axis; k, v, dk, dv on k_*

so the rest of the kernel reads ``x[b, row, ...]`` with rows and lengths local to that sequence, as in a
padded batch, and masks, ALiBi and the user's functions see local indices: the call equals one call per
sequence. The kernels that narrow every operand at once take their views from `forward_operands`, `dq_operands`
or `dkdv_operands` (a device function may return views: numba-cuda 0.30 compiles it); v5 narrows only what it
reads and where (its forward narrows out and lse after its loop: views live through it kept 60-120 bytes of local
memory). ``PACKED`` is a compile-time constant, so other kernels compile without it.
The grid of a varlen call covers its longest sequence: a block whose first row (or key) lies past its
own sequence's length returns at once.

The v5 backward reads its rows' LSE and D from a staged preprocess's ``stats`` in bulk, 16-byte aligned
and padded to whole tiles past each sequence (`simt.backward.build_staged_preprocess`). For packed
sequences ``stats`` is one batch element whose sequence ``b`` has its segment from row ``stats_start(cu_seqlens_q[b],
b, whole)``: aligned to 4 floats, and ``whole + 4`` rows per sequence before it leave room for each one's
padding; ``stats_start(total_q, num_sequences, whole)`` rows hold them all.
"""

import math

from .intrinsics import device_function, warp_uniform


def stats_tile_rows(tiles):
    """The rows a staged ``stats`` pads each sequence (or batch element) to: whole tiles of both backward passes,
    whose blocks own ``block_m`` rows and stream ``block_n``."""
    return math.lcm(tiles.block_m, tiles.block_n)


@device_function
def stats_start(q_start, b, whole):
    """The first row of packed sequence ``b`` (its first query row ``q_start``) in a staged ``stats`` whose
    tiles pad to ``whole`` rows."""
    return (q_start + 3) // 4 * 4 + b * (whole + 4)


def sequence_starts(mods, whole=1):
    """``starts(mod, b)``: where the v5 kernels' bulk copies find batch element (or packed sequence) ``b``:
    ``(q_start, k_start, stats_first, at)``, its first query row and first key, its first row in a staged
    ``stats`` of ``whole``-row tiles (`stats_start`), and the batch index the tensor maps and ``stats`` take.
    A packed sequence's operands are one tensor map's rows (`wgmma.tensor_maps.spec`), so ``at`` is 0 and the
    rest its offsets; a batch element's are ``(0, 0, 0, b)``."""
    sequence = sequences(mods)

    if mods.packed:
        @device_function
        def starts(mod, b):
            q_start, _, k_start, _ = sequence(mod, b)
            return q_start, k_start, stats_start(q_start, b, whole), 0
    else:
        @device_function
        def starts(mod, b):
            return 0, 0, 0, b

    return starts


def sequences(mods):
    """``sequence(mod, b)``: the bounds ``(q_start, q_end, k_start, k_end)`` of packed sequence ``b``, called by whole
    warps (each bound is lane 0's, `warp_uniform`)."""
    # Loaded into per-thread registers, the bounds made everything the loops derive from them per-thread to ptxas:
    # v5's wgmma descriptors went through R2UR each tile, and its packed kernels spilled where the same kernels on a
    # batch keep no local memory (ptxas 13.0: the forwards 36-68 bytes stored and 124-160 loaded at headdim 64 and
    # 128, the dK/dV pass 24 and 268 stored; none with the bounds uniform).
    # cu_seqlens_q's and cu_seqlens_k's places in the mod tuple (constants: the tuple's members differ in type)
    CU_Q_AT = int(mods.block_sparse)
    CU_K_AT = CU_Q_AT + 1

    if mods.packed:
        @device_function
        def sequence(mod, b):
            cu_q, cu_k = mod[CU_Q_AT], mod[CU_K_AT]
            return (warp_uniform(cu_q[b]), warp_uniform(cu_q[b + 1]), warp_uniform(cu_k[b]),
                    warp_uniform(cu_k[b + 1]))
    else:
        @device_function
        def sequence(mod, b):  # never called: kernels narrow only when PACKED
            return 0, 0, 0, 0

    return sequence


def forward_operands(mods):
    """``operands(mod, z, q, k, v, out, lse)``: a forward's operands, narrowed to packed sequence ``z`` with
    ``mods.packed`` (q and out on their rows, lse on its last axis, k and v on their keys), else as they are."""
    sequence = sequences(mods)

    if mods.packed:
        @device_function
        def operands(mod, z, q, k, v, out, lse):
            q_start, q_end, k_start, k_end = sequence(mod, z)
            return (q[:, q_start:q_end], k[:, k_start:k_end], v[:, k_start:k_end], out[:, q_start:q_end],
                    lse[:, :, q_start:q_end])
    else:
        @device_function
        def operands(mod, z, q, k, v, out, lse):
            return q, k, v, out, lse

    return operands


def dq_operands(mods):
    """``operands(mod, z, q, k, v, dout, lse, delta, dq)``: a dQ pass's operands, narrowed as `forward_operands`
    narrows a forward's (dout and dq on their rows like q, delta like lse)."""
    sequence = sequences(mods)

    if mods.packed:
        @device_function
        def operands(mod, z, q, k, v, dout, lse, delta, dq):
            q_start, q_end, k_start, k_end = sequence(mod, z)
            return (q[:, q_start:q_end], k[:, k_start:k_end], v[:, k_start:k_end], dout[:, q_start:q_end],
                    lse[:, :, q_start:q_end], delta[:, :, q_start:q_end], dq[:, q_start:q_end])
    else:
        @device_function
        def operands(mod, z, q, k, v, dout, lse, delta, dq):
            return q, k, v, dout, lse, delta, dq

    return operands


def dkdv_operands(mods):
    """``operands(mod, z, q, k, v, dout, lse, delta, dk, dv)``: a dK/dV pass's operands, narrowed as `dq_operands`
    narrows a dQ pass's (dk and dv on their keys like k)."""
    sequence = sequences(mods)

    if mods.packed:
        @device_function
        def operands(mod, z, q, k, v, dout, lse, delta, dk, dv):
            q_start, q_end, k_start, k_end = sequence(mod, z)
            return (q[:, q_start:q_end], k[:, k_start:k_end], v[:, k_start:k_end], dout[:, q_start:q_end],
                    lse[:, :, q_start:q_end], delta[:, :, q_start:q_end], dk[:, k_start:k_end], dv[:, k_start:k_end])
    else:
        @device_function
        def operands(mod, z, q, k, v, dout, lse, delta, dk, dv):
            return q, k, v, dout, lse, delta, dk, dv

    return operands
