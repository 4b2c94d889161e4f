"""Block sizes for each schedule, derived from the SRAM budget M (in elements), and their working sets.

``footprint`` is the number of elements a schedule holds in SRAM during its largest tile step; the
schedules allocate exactly these tiles, so a rule whose footprint fits can never overflow. Sizes are
capped at the sequence lengths (a larger block changes nothing but the report).
"""

import math
from dataclasses import dataclass

from .hierarchy import SramOverflow


@dataclass(frozen=True)
class Blocks:
    """Query rows per block (B_r) and keys per block (B_c). ``dkdv``: the two-pass backward's dK/dV pass's
    own blocks where they differ: a kernel that owns ``block_m`` rows and streams ``block_n`` in both passes
    (the Hopper backward) has B_r x B_c = block_m x block_n in the dQ pass and block_n x block_m in the
    dK/dV pass."""

    rows: int
    cols: int
    dkdv: "Blocks | None" = None

    @property
    def key_pass(self):
        """The dK/dV pass's blocks."""
        return self.dkdv or self


def footprint(algorithm, backward, d, br, bc, dq="accumulate", key_pass=None):
    """Elements resident in SRAM during the schedule's largest step with blocks ``br`` x ``bc``."""
    if algorithm == "standard":
        # A GEMM step: two operand tiles and one output tile.
        return br * bc + br * d + bc * d
    if algorithm == "flash1":
        if not backward:
            # K_j, V_j | Q_i, O_i | l_i, m_i, tile max, tile sum, new max, new sum | S_ij (P_ij in place)
            return 2 * bc * d + 2 * br * d + 6 * br + br * bc
        # K_j, V_j, dK_j, dV_j | Q_i, O_i, dO_i, dQ_i | l_i, m_i, D_i | S/P and dP/dS
        return 4 * bc * d + 4 * br * d + 3 * br + 2 * br * bc
    if not backward:
        # Q_i and its O accumulator | m_i, l_i | K_j, V_j | S_ij (P_ij in place)
        return 2 * br * d + 2 * br + 2 * bc * d + br * bc
    if dq in ("accumulate", "atomic"):
        # K_j, V_j, dK_j, dV_j | Q_i, dO_i, dQ_i | LSE_i, D_i | S/P and dP/dS
        return 4 * bc * d + 3 * br * d + 2 * br + 2 * br * bc
    # Two passes: dK/dV (K_j, V_j, dK_j, dV_j | Q_i, dO_i | LSE_i, D_i | S/P, dP/dS) on ``key_pass`` blocks
    # (B_r x B_c; by default the dQ pass's) and dQ (Q_i, dO_i, dQ_i | LSE_i, D_i | K_j, V_j | S/P, dP/dS).
    kr, kc = key_pass or (br, bc)
    dkdv = 4 * kc * d + 2 * kr * d + 2 * kr + 2 * kr * kc
    dqp = 3 * br * d + 2 * br + 2 * bc * d + 2 * br * bc
    return max(dkdv, dqp)


def softmax_rows(M, seqlen_k, backward):
    """Rows per step of the standard algorithm's row-wise pass (softmax, or dS in the backward).

    A row of S (and of dP in the backward) must be resident whole: Algorithm 0 reads S once and
    normalizes each row in SRAM. Needs M >= seqlen_k (2 * seqlen_k backward).
    """
    per_row = (2 if backward else 1) * seqlen_k
    return max(1, M // per_row)


def _too_small(algorithm, M, need):
    return SramOverflow(f"{algorithm}: an SRAM of {M} elements is too small; its smallest tiles need {need}")


def standard(M, d, seqlen_q, seqlen_k):
    """Square GEMM tiles: the largest b with b^2 + 2bd <= M, i.e. b = floor(sqrt(d^2 + M) - d)."""
    b = math.isqrt(d * d + M) - d
    if b < 1:
        raise _too_small("standard", M, 1 + 2 * d)
    return Blocks(min(b, seqlen_q), min(b, seqlen_k))


def flash1(M, d, seqlen_q, seqlen_k, backward):
    """The paper's rule B_c = ceil(M'/4d), B_r = min(ceil(M'/4d), d), on an effective budget M' <= M.

    Taken literally with M' = M the rule overflows: it budgets M for the four B x d blocks (Q_i,
    K_j, V_j, O_i) and leaves out the B_r x B_c score tile and the row statistics, up to M/4 + O(d)
    more. We feed the rule the largest M' whose whole working set (`footprint`) fits in M. Since
    footprint(M') <= 1.25 M' + O(d), M' >= 0.8 M - O(d): the traffic stays Theta(N^2 d^2 / M).
    """

    def rule(m):
        bc = -(-m // (4 * d))
        return min(bc, d), bc

    lo, hi = 0, M  # largest m in [1, M] with footprint(rule(m)) <= M, by bisection (footprint grows with m)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if footprint("flash1", backward, d, *rule(mid)) <= M:
            lo = mid
        else:
            hi = mid - 1
    if lo < 1:
        raise _too_small("flash1", M, footprint("flash1", backward, d, 1, 1))
    br, bc = rule(lo)
    return Blocks(min(br, seqlen_q), min(bc, seqlen_k))


def flash2(M, d, seqlen_q, seqlen_k, backward, dq="accumulate"):
    """FlashAttention-2's blocks, derived so that the traffic is Theta(N^2 d^2 / M) inside M.

    Forward. Q_i, O_i and the row statistics are read or written once; K and V are streamed once per
    query block, so the traffic is  2 N d + N + 2 N d * ceil(N / B_r):  only B_r matters. The working
    set is  B_r (2d + 2 + B_c) + 2 B_c d <= M. Give K_j and V_j at most a quarter of M and never more
    than d keys (wider key blocks only shrink B_r):  B_c = clamp(floor(M / 8d), 1, d).  Then B_r is
    the largest block that fits beside them:  B_r = floor((M - 2 B_c d) / (2d + 2 + B_c)).
    Since 2 B_c d <= M/4 and B_c <= d,  B_r >= (3M/4) / (3d + 2) = Theta(M / d), hence the traffic
    2 N d * N / B_r = Theta(N^2 d^2 / M).

    Backward (dQ accumulated in HBM, the paper's Algorithm 2). K_j, V_j, dK_j, dV_j stay on chip for a
    whole pass over the query blocks, which reads Q_i, dO_i, LSE_i, D_i and reads and writes dQ_i:
    4 N d + 2 N per key block, so only B_c matters. The working set is
    B_c (4d + 2 B_r) + B_r (3d + 2) <= M. With B_r = clamp(floor(M / 12d), 1, d) the query side takes
    at most about a third of M, and  B_c = floor((M - B_r (3d + 2)) / (4d + 2 B_r)) >= (M/2) / (6d)
    = Theta(M / d), hence Theta(N^2 d^2 / M) again.

    Backward in two passes (``dq="separate"``): the dK/dV pass wants a large B_c and the dQ pass a
    large B_r, and both hold 2 B_r B_c score elements. Square blocks B_r = B_c = b with the larger
    working set  2b^2 + 6bd + 2b <= M  give b = Theta(M / d) while M <= d^2, and the traffic of
    either pass is Theta(N^2 d / b) = Theta(N^2 d^2 / M).
    """
    if backward and dq == "separate":
        b = 0
        while footprint("flash2", True, d, b + 1, b + 1, dq) <= M:
            b += 1
        br = bc = b
    elif not backward:
        bc = max(1, min(M // (8 * d), d, seqlen_k))
        br = (M - 2 * bc * d) // (2 * d + 2 + bc)
    else:
        br = max(1, min(M // (12 * d), d, seqlen_q))
        bc = (M - br * (3 * d + 2)) // (4 * d + 2 * br)
    if br < 1 or bc < 1:
        raise _too_small("flash2", M, footprint("flash2", backward, d, 1, 1))
    return Blocks(min(br, seqlen_q), min(bc, seqlen_k))


def derive(algorithm, M, d, seqlen_q, seqlen_k, backward, dq="accumulate"):
    """The block sizes ``algorithm`` uses with an SRAM of M elements."""
    if algorithm == "standard":
        return standard(M, d, seqlen_q, seqlen_k)
    if algorithm == "flash1":
        return flash1(M, d, seqlen_q, seqlen_k, backward)
    return flash2(M, d, seqlen_q, seqlen_k, backward, dq)


def min_sram(algorithm, d, seqlen_k, backward, dq="accumulate"):
    """The smallest M (elements) for which ``algorithm`` has feasible derived blocks."""
    if algorithm == "standard":
        return max(1 + 2 * d, (2 if backward else 1) * seqlen_k)
    return footprint(algorithm, backward, d, 1, 1, dq)
