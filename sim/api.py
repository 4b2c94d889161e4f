"""`count_io`: run one schedule on the simulated hierarchy, count its traffic, check it two ways.

Every (batch element, kv head) runs the same schedule on its own tensors, so a run simulates one of
them, its GQA group of query heads included, and multiplies its counts by batch x nheads_kv: exact, and
what lets the FlashAttention paper's Figure 2 setting (64 x 16 heads) count in well under a second.
Every run is checked against the closed form for its schedule (`Report.predicted`) and, where the
float64 reference of that group fits `CHECK_ELEMENTS` scores, its values against the reference;
``Report.checked`` says which.
"""

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from numbaflash import arguments, mods, reference
from numbaflash.block_sparsity import BlockMask
from numbaflash.masks import normalize_window
from numbaflash.tiling import Plan

from . import blocks as block_rules
from . import formulas
from .algorithms import common, flash1, flash2, standard
from .hierarchy import Hierarchy, SramOverflow
from .problem import Problem

ALGORITHMS = ("standard", "flash1", "flash2")
# Scores (seqlen_q x seqlen_k x query heads of one group) up to which count_io checks values against the
# float64 reference by default: its S and P take 8 bytes each, about 0.3 GB at this size.
CHECK_ELEMENTS = 2**24
DQ_MODES = ("accumulate", "separate", "atomic")


class SimulationMismatch(AssertionError):
    """A schedule's result differs from the float64 reference."""


@dataclass
class Report:
    """What one schedule moved. Counts are in elements; ``total_bytes`` = ``total`` x ``dtype_bytes``."""

    algorithm: str
    direction: str
    problem: Problem
    sram_elems: int
    dtype_bytes: int
    blocks: block_rules.Blocks
    dq: str
    reads: int
    writes: int
    per_tensor: dict
    tiles: list
    predicted: dict
    asymptotic: dict
    peak_sram: int
    uncharged: dict
    max_rel_error: float = None
    checked: str = ""
    copies: int = 1  # (batch, kv head) groups the ledger's one simulated group stands for
    extra: dict = field(default_factory=dict)

    @property
    def total(self):
        return self.reads + self.writes

    @property
    def total_bytes(self):
        return self.total * self.dtype_bytes

    @property
    def matches_prediction(self):
        return self.total == self.predicted["total"] and self.per_tensor == self.predicted["per_tensor"]


def _inputs(p, ctx_args, backward, algorithm, rng):
    """Random float64 inputs in HBM, plus what the backward pass reads from the forward."""
    b, nq, nk, h, hk, d = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.headdim
    q = rng.standard_normal((b, nq, h, d))
    k = rng.standard_normal((b, nk, hk, d))
    v = rng.standard_normal((b, nk, hk, d))
    hbm = {"Q": q, "K": k, "V": v}
    if not backward:
        return hbm
    out, lse = reference.attention_forward(q, k, v, **ctx_args)
    hbm.update(O=out, LSE=lse, dO=rng.standard_normal(q.shape))
    if algorithm == "standard":
        hbm["P"] = reference.attention_probabilities(q, k, **ctx_args)
    if algorithm == "flash1":
        # Algorithm 4 needs P = exp(S - m) / l; with m = LSE and l = 1 that is exp(S - LSE) exactly.
        hbm.update(m=lse.copy(), l=np.isfinite(lse).astype(np.float64))
    return hbm


def _outputs(p, algorithm, backward, dq=None, staged=False):
    """Shapes of what the schedule writes (intermediates in HBM included; ``dq`` "atomic": dQ_acc; ``staged``:
    LSE2, the LSE staged beside D)."""
    b, nq, nk, h, hk, d = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.headdim
    q_like, kv_like, nn, row = (b, nq, h, d), (b, nk, hk, d), (b, h, nq, nk), (b, h, nq)
    if not backward:
        extra = {"standard": {"S": nn, "P": nn}, "flash1": {"l": row, "m": row}, "flash2": {"LSE": row}}[algorithm]
        return {"O": q_like, **extra}
    extra = {"standard": {"dP": nn, "dS": nn}, "flash1": {}, "flash2": {"D": row}}[algorithm]
    if algorithm == "flash2" and dq == "atomic":
        extra["dQ_acc"] = q_like
    if algorithm == "flash2" and staged:
        extra["LSE2"] = row
    return {"dQ": q_like, "dK": kv_like, "dV": kv_like, **extra}


def _input_shapes(p, algorithm, backward):
    b, nq, nk, h, hk, d = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.headdim
    shapes = {"Q": (b, nq, h, d), "K": (b, nk, hk, d), "V": (b, nk, hk, d)}
    if backward:
        shapes.update(O=(b, nq, h, d), dO=(b, nq, h, d), LSE=(b, h, nq))
        shapes.update({"standard": {"P": (b, h, nq, nk)}, "flash1": {"m": (b, h, nq), "l": (b, h, nq)}, "flash2": {}}[algorithm])
    return shapes


def _max_rel_error(got, want):
    """max |got - want| / max(max |want|, 1) over finite reference entries; -inf entries must match.

    The floor of 1 keeps results that are exactly zero in the reference (dQ and dK with one key) from
    turning rounding noise into an infinite relative error; the inputs are unit normal, so results
    are of order 1 and this is a relative tolerance wherever it matters.
    """
    finite = np.isfinite(want)
    if not np.array_equal(np.isneginf(got), np.isneginf(want)) or np.isnan(got).any():
        return np.inf
    scale = max(np.abs(want[finite]).max(initial=0.0), 1.0)
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0) / scale)


def _verify(h, hbm_in, algorithm, backward, ctx_args):
    q, k, v = hbm_in["Q"], hbm_in["K"], hbm_in["V"]
    got = h.arrays
    if not backward:
        out, lse = reference.attention_forward(q, k, v, **ctx_args)
        error = _max_rel_error(got["O"], out)
        if algorithm == "flash1":
            with np.errstate(divide="ignore"):
                error = max(error, _max_rel_error(np.where(got["l"] > 0, got["m"] + np.log(got["l"]), -np.inf), lse))
        elif algorithm == "flash2":
            error = max(error, _max_rel_error(got["LSE"], lse))
        return error  # standard attention keeps P, not the LSE
    dq, dk, dv = reference.attention_backward(hbm_in["dO"], q, k, v, **ctx_args)
    return max(_max_rel_error(got["dQ"], dq), _max_rel_error(got["dK"], dk), _max_rel_error(got["dV"], dv))


def _resolve(seqlen, headdim, sram_bytes, algorithm, seqlen_k, batch, nheads, nheads_kv, causal, window_size,
             backward, dtype_bytes, block_sizes, dq, plan, block_mask=None, check_fit=False):
    """Validate the arguments shared by `count_io` and `predict_io`; the problem, M and the blocks.

    ``check_fit``: refuse given blocks that do not fit M, as running the schedule would (`predict_io`
    runs nothing; `count_io`'s own overflow names the tiles)."""
    key_pass, staged = None, False
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be None or a numbaflash.plan(...) result; got {type(plan).__name__}")
        algorithm, block_sizes, dq = "flash2", (plan.block_m, plan.block_n), plan.dq_strategy
        # A backward kernel owns block_m rows and streams block_n in both passes: the dK/dV pass's blocks are
        # the transpose of the dQ pass's. With atomics the key pass is the only one.
        if backward and dq == "atomic":
            block_sizes = (plan.block_n, plan.block_m)
        if backward and dq == "separate" and plan.block_m != plan.block_n:
            key_pass = (plan.block_n, plan.block_m)
        sram_bytes = plan.sram_bytes if sram_bytes is None else sram_bytes
        dtype_bytes = plan.dtype_bytes
        # v5's preprocess stages each row's LSE beside D, where its producers copy both in bulk.
        staged = backward and plan.staged_statistics
    arguments.choice(algorithm, "algorithm", ALGORITHMS)
    arguments.choice(dq, "dq", DQ_MODES)
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    nheads_kv = nheads if nheads_kv is None else nheads_kv
    for name, value in (("seqlen", seqlen), ("seqlen_k", seqlen_k), ("headdim", headdim), ("batch", batch),
                        ("nheads", nheads), ("nheads_kv", nheads_kv), ("dtype_bytes", dtype_bytes)):
        arguments.positive_int(value, name)
    if nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if sram_bytes is None:
        raise ValueError("sram_bytes is required (or plan=, whose SRAM is used)")
    arguments.positive_int(sram_bytes, "sram_bytes")
    if sram_bytes < dtype_bytes:
        raise ValueError(f"sram_bytes must hold at least one element of {dtype_bytes} bytes, got {sram_bytes!r}")
    arguments.flag(causal, "causal")
    arguments.flag(backward, "backward")
    left, right = normalize_window(causal, arguments.window(window_size))
    p = Problem(seqlen, seqlen_k, headdim, batch, nheads, nheads_kv, left, right)
    M = sram_bytes // dtype_bytes
    if block_sizes is None:
        blocks = block_rules.derive(algorithm, M, headdim, seqlen, seqlen_k, backward, dq)
    else:
        if not (isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2):
            raise ValueError(f"block_sizes must be a pair (B_r, B_c) of integers >= 1, got {block_sizes!r}")
        blocks = block_rules.Blocks(*(arguments.positive_int(b, "block_sizes entries") for b in block_sizes),
                                    dkdv=block_rules.Blocks(*key_pass) if key_pass else None)
    if block_sizes is not None and check_fit:
        # The schedules allocate exactly their footprint, so this is where `count_io` would overflow.
        need = block_rules.footprint(algorithm, backward, headdim, blocks.rows, blocks.cols, dq, key_pass)
        if algorithm == "standard":
            need = max(need, (2 if backward else 1) * seqlen_k)  # whole rows of S (and dP) for the softmax
        if need > M:
            raise SramOverflow(f"{algorithm}: blocks {blocks.rows} x {blocks.cols} need {need} elements of SRAM at "
                               f"headdim {headdim}; M = {M}")
    if block_mask is not None:
        _check_block_mask(block_mask, algorithm, p)
        p = dataclasses.replace(p, block_mask=block_mask)
    return algorithm, p, M, blocks, dq, dtype_bytes, staged


def _check_block_mask(block_mask, algorithm, p):
    """A block mask for FlashAttention-2 (whose schedules, as the kernels, skip the tiles it empties)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be None or what numbaflash.block_mask(...) returns; got "
                        f"{type(block_mask).__name__}")
    if algorithm != "flash2":
        raise ValueError(f"block_mask: only FlashAttention-2's schedules skip the tiles a block mask empties; got "
                         f"algorithm {algorithm!r}")
    block_mask.check_sizes(p.batch, p.nheads, p.seqlen_q, p.seqlen_k)


def predict_io(seqlen, headdim, *, sram_bytes=None, algorithm="flash2", seqlen_k=None, batch=1, nheads=1,
               nheads_kv=None, causal=False, window_size=(-1, -1), backward=False, dtype_bytes=2,
               block_sizes=None, dq="accumulate", plan=None, block_mask=None):
    """The closed form of `count_io`'s count, without running the schedule (instant once the block mask, if
    any, is evaluated).

    Same arguments as `count_io`. Returns ``{"reads", "writes", "total", "per_tensor", "total_bytes",
    "blocks"}``; `count_io` checks that the schedule moves exactly this.
    """
    algorithm, p, M, blocks, dq, dtype_bytes, staged = _resolve(
        seqlen, headdim, sram_bytes, algorithm, seqlen_k, batch, nheads, nheads_kv, causal, window_size,
        backward, dtype_bytes, block_sizes, dq, plan, block_mask, check_fit=True)
    prediction = formulas.predicted(algorithm, backward, p, blocks, dq, staged)
    return {**prediction, "total_bytes": prediction["total"] * dtype_bytes, "blocks": blocks}


def count_io(seqlen, headdim, *, sram_bytes=None, algorithm="flash2", seqlen_k=None, batch=1, nheads=1,
             nheads_kv=None, causal=False, window_size=(-1, -1), backward=False, dtype_bytes=2,
             block_sizes=None, dq="accumulate", plan=None, block_mask=None, compute=True, rtol=1e-10, seed=0):
    """Run ``algorithm`` on a simulated HBM + SRAM hierarchy and count every element it moves.

    Args:
        seqlen, headdim: N_q and d. ``seqlen_k`` defaults to ``seqlen``.
        sram_bytes: SRAM capacity; M = sram_bytes // dtype_bytes elements. Defaults to ``plan.sram_bytes``.
        algorithm: "standard", "flash1" or "flash2".
        batch, nheads, nheads_kv: heads of K and V default to ``nheads``; nheads must be a multiple.
        causal, window_size: the mask, as in `numbaflash.attention`.
        backward: count the backward pass alone (its inputs, such as O and LSE, are already in HBM).
        dtype_bytes: bytes per element, for M and ``total_bytes``.
        block_sizes: ``(B_r, B_c)`` replacing the derived blocks.
        dq: FlashAttention-2 backward only: "accumulate" (the paper: dQ read and written in HBM per
            step), "separate" (numbaflash's deterministic kernels: a dK/dV pass, then a dQ pass) or "atomic"
            (``deterministic=False``: the paper's schedule with dQ summed in a float32 dQ_acc, then rounded
            into dQ in a pass of its own).
        plan: a `numbaflash.Plan`: count the schedule a kernel ran (its blocks, SRAM and dQ strategy).
        block_mask: a `numbaflash.block_mask(...)` (FlashAttention-2, forward or backward): count only the
            tiles it leaves non-empty, as the kernels visit them. Every (batch element, head) is then simulated, and
            values are checked where the mask is shared by all of them (its batch and nheads None).
        compute: carry values and check the result against the float64 reference (``rtol``) where one
            group's scores fit `CHECK_ELEMENTS`; with False, only count. ``Report.checked`` says which ran.

    Returns a `Report`; its ``tiles`` ledger holds the steps of the one simulated (batch, kv head) group.
    Raises `SramOverflow` if a step does not fit and `SimulationMismatch` if the result differs from the
    reference.
    """
    algorithm, p, M, blocks, dq, dtype_bytes, staged = _resolve(
        seqlen, headdim, sram_bytes, algorithm, seqlen_k, batch, nheads, nheads_kv, causal, window_size,
        backward, dtype_bytes, block_sizes, dq, plan, block_mask)
    arguments.flag(compute, "compute")
    ctx_args = dict(causal=causal, softmax_scale=1.0 / np.sqrt(headdim), window_size=window_size)
    unchecked = ""
    if p.block_mask is None:
        # One (batch element, kv head) group; the others repeat its schedule on their own tensors.
        group = Problem(p.seqlen_q, p.seqlen_k, headdim, 1, p.group, 1, p.left, p.right)
    else:  # a block mask may differ per batch element and head: every one runs
        group = p
        ctx_args.update(mask_mod=block_mask.mask_mod, mod_args=block_mask.mod_args)
        if block_mask.batch is not None or block_mask.nheads is not None:
            unchecked = "the block mask differs per batch element or head, and the schedule's scores take one mask"
    copies = p.batch * p.nheads_kv // (group.batch * group.nheads_kv)
    scores = p.seqlen_q * p.seqlen_k * group.batch * group.nheads
    verify = compute and scores <= CHECK_ELEMENTS and not unchecked
    if verify:
        hbm_in = _inputs(group, ctx_args, backward, algorithm, np.random.default_rng(seed))
        hbm = dict(hbm_in)
        # Outputs start as NaN: an element the schedule never writes fails the check.
        hbm.update({name: np.full(shape, np.nan) for name, shape in _outputs(group, algorithm, backward, dq, staged).items()})
        visible = reference.visible_mask(p.seqlen_q, p.seqlen_k, causal, window_size)
        if block_mask is not None:  # shared by every batch element and head (else ``unchecked``)
            visible = visible & mods.visible(block_mask.mask_mod, (1, 1, p.seqlen_q, p.seqlen_k), block_mask.mod_args)[0, 0]
        ctx = common.Context(ctx_args["softmax_scale"], visible)
    else:
        hbm = {**_input_shapes(group, algorithm, backward), **_outputs(group, algorithm, backward, dq, staged)}
        ctx = common.Context(ctx_args["softmax_scale"])
    h = Hierarchy(M, hbm, compute=verify)

    if algorithm == "standard":
        rows = block_rules.softmax_rows(M, p.seqlen_k, backward)
        (standard.backward if backward else standard.forward)(h, group, blocks, ctx, rows)
    elif algorithm == "flash1":
        (flash1.backward if backward else flash1.forward)(h, group, blocks, ctx)
    elif backward:
        flash2.backward(h, group, blocks, ctx, dq=dq, staged=staged)
    else:
        flash2.forward(h, group, blocks, ctx)

    reads, writes, uncharged = ({n: c * copies for n, c in counter.items()}
                                for counter in (h.reads, h.writes, h.uncharged))
    names = sorted(set(reads) | set(writes))
    per_tensor = {n: {"reads": reads.get(n, 0), "writes": writes.get(n, 0)} for n in names}
    predicted = formulas.predicted(algorithm, backward, p, blocks, dq, staged)
    predicted["formula"] = formulas.FORMULAS[(algorithm, backward)]
    formula, value = formulas.asymptotic(algorithm, p, M)
    total = sum(reads.values()) + sum(writes.values())
    simulated = (f"one (batch, kv head) group of {p.group} query head{'s' * (p.group > 1)} simulated, "
                 f"its counts x {copies}" if copies > 1 else "every head simulated")
    if verify:
        checked = f"counts against the closed form; values against the float64 reference ({simulated})"
    elif compute and unchecked:
        checked = f"counts against the closed form; values not checked: {unchecked} ({simulated})"
    elif compute:
        checked = (f"counts against the closed form; values not checked: {scores:,} scores exceed the "
                   f"{CHECK_ELEMENTS:,} of the float64 check ({simulated})")
    else:
        checked = f"counts against the closed form; values not computed (compute=False; {simulated})"
    report = Report(
        algorithm=algorithm, direction="backward" if backward else "forward", problem=p, sram_elems=M,
        dtype_bytes=dtype_bytes, blocks=blocks, dq=dq if (algorithm == "flash2" and backward) else None,
        reads=sum(reads.values()), writes=sum(writes.values()), per_tensor=per_tensor, tiles=h.steps,
        predicted=predicted, asymptotic={"formula": formula, "value": value, "ratio": total / value},
        peak_sram=h.peak, uncharged=uncharged, checked=checked, copies=copies,
    )
    if verify:
        report.max_rel_error = _verify(h, hbm_in, algorithm, backward, ctx_args)
        if not report.max_rel_error <= rtol:
            raise SimulationMismatch(
                f"{algorithm} {report.direction}: result differs from the float64 reference by "
                f"{report.max_rel_error:.3e} relative (tolerance {rtol:g})"
            )
    return report
