"""The seeds' worked examples of the online-softmax update, block by block."""

import numpy as np

from sim import online_softmax


def run(scores, values, block, threshold=0.0):
    s = np.asarray(scores, dtype=np.float64)[None, :]  # one query row
    v = np.asarray(values, dtype=np.float64)[:, None]  # (keys, 1)
    m, l, acc = np.array([-np.inf]), np.zeros(1), np.zeros((1, 1))
    history = []
    for c in range(0, s.shape[1], block):
        m, l, acc = online_softmax.update(m, l, acc, s[:, c:c + block], v[c:c + block], threshold)
        history.append((m[0], l[0]))
    return history, online_softmax.finalize(m, l, acc)


def test_seed_000_six_scores_in_blocks_of_two():
    history, _ = run([1, 3, 2, 5, 4, 0], np.ones(6), 2)
    # Block 1: m = 3, l = 1.1353; block 2 rescales by exp(-2) and adds 1.0498; block 3 adds 0.3746.
    np.testing.assert_allclose([h[0] for h in history], [3, 5, 5])
    np.testing.assert_allclose([h[1] for h in history], [1.1353, 1.2035, 1.578], atol=5e-4)
    np.testing.assert_allclose(history[-1][1], np.exp(np.array([1, 3, 2, 5, 4, 0]) - 5.0).sum(), rtol=1e-15)


def test_seed_003_weighted_values_give_30_86():
    history, (out, lse) = run([2, 3, 5, 4], [10, 20, 30, 40], 2)
    np.testing.assert_allclose(history[0][1], 1.368, atol=5e-4)
    np.testing.assert_allclose(history[1][1], 1.553, atol=5e-4)
    np.testing.assert_allclose(out[0, 0], 30.86, atol=5e-3)
    np.testing.assert_allclose(lse[0], np.log(np.exp([2, 3, 5, 4]).sum()), rtol=1e-15)


def test_seed_001_large_logits_stay_finite():
    history, (out, lse) = run([1000, 1001, 1002, 999], [1, 2, 3, 4], 2)
    assert all(np.isfinite(m) and np.isfinite(l) for m, l in history)
    w = np.exp(np.array([1000, 1001, 1002, 999]) - 1002.0)
    np.testing.assert_allclose(out[0, 0], (w @ [1, 2, 3, 4]) / w.sum(), rtol=1e-15)
    np.testing.assert_allclose(lse[0], 1002 + np.log(w.sum()), rtol=1e-15)


def test_seed_000_with_a_threshold_keeps_the_first_max_and_the_result():
    # Blocks 2 and 3 exceed the first block's max 3 by 2 and 1, under the threshold 2.5: m stays 3, and l sums
    # exp(s - 3) (up to e^2), the same softmax.
    history, (out, lse) = run([1, 3, 2, 5, 4, 0], [1, 2, 3, 4, 5, 6], 2, threshold=2.5)
    _, (out0, lse0) = run([1, 3, 2, 5, 4, 0], [1, 2, 3, 4, 5, 6], 2)
    np.testing.assert_allclose([h[0] for h in history], [3, 3, 3])
    np.testing.assert_allclose(history[-1][1], np.exp(np.array([1, 3, 2, 5, 4, 0]) - 3.0).sum(), rtol=1e-15)
    np.testing.assert_allclose(out, out0, rtol=1e-14)
    np.testing.assert_allclose(lse, lse0, rtol=1e-15)


def test_the_kernels_threshold_moves_the_max_rarely_and_gives_the_same_softmax():
    """Rows whose scores drift upward over 64 tiles, rows that see no key in their first tiles (-inf), and one
    that sees none at all: the kernels' threshold (8 in base 2) moves the max at fewer tiles than the plain
    recurrence and gives the same output and LSE."""
    rng = np.random.default_rng(0)
    rows, cols, block, d = 16, 1024, 16, 8
    s = rng.standard_normal((rows, cols)) * 3 + np.linspace(0, 12, cols)[None, :]
    s[3:6, :100] = -np.inf
    s[7] = -np.inf
    v = rng.standard_normal((cols, d))
    results = []
    for threshold in (0.0, 8 * np.log(2)):
        m, l, acc = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d))
        moves = 0
        for c in range(0, cols, block):
            m_old = m
            m, l, acc = online_softmax.update(m, l, acc, s[:, c:c + block], v[c:c + block], threshold)
            moves += int((m != m_old).sum())
        results.append((moves, *online_softmax.finalize(m, l, acc)))
    (moves0, out0, lse0), (moves, out, lse) = results
    assert moves < moves0 / 2, (moves, moves0)
    np.testing.assert_allclose(out, out0, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse0))
    np.testing.assert_allclose(lse[~np.isinf(lse)], lse0[~np.isinf(lse0)], rtol=1e-14)
    assert (out[7] == 0).all() and lse[7] == -np.inf
