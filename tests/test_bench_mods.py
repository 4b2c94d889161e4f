"""`scripts/bench_mods.py --jobs` shares the variants among its worker processes (no GPU needed)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_mods  # noqa: E402

LISTED = [(name, {}, "causal (built-in)" if "block mask" in name else None) for name in bench_mods.NAMES]


def test_every_variant_is_timed_by_one_worker_beside_its_base():
    """For 1 to 9 workers: each variant that is no base in exactly one share, every share holding the bases its
    variants are timed against and nothing else, in the listed order; one worker takes the whole list; a worker
    left without a variant takes nothing."""
    base_of = bench_mods.bases(LISTED)
    assert base_of["softcap 30"] == "plain" and base_of["causal (mask_mod)"] == "causal (built-in)"
    assert base_of["8 documents (block mask)"] == "causal (built-in)" and base_of["plain"] == "plain"
    variants = [name for name, _, _ in LISTED if name not in bench_mods.BASES]
    assert bench_mods.share_of(LISTED, base_of, (0, 1)) == LISTED
    for count in range(1, len(LISTED) + 1):
        shares = [[name for name, _, _ in bench_mods.share_of(LISTED, base_of, (i, count))] for i in range(count)]
        mine = [[name for name in share if name not in bench_mods.BASES] for share in shares]
        assert sorted(sum(mine, [])) == sorted(variants), count
        for share, own in zip(shares, mine):
            assert set(share) == set(own) | {base_of[name] for name in own}, (count, share)
            assert share == [name for name, _, _ in LISTED if name in share], (count, share)
        assert sum(1 for own in mine if not own) == max(0, count - len(variants)), count


def test_chosen_variants_come_with_their_bases_and_nothing_else():
    """--variants: the named variants and the bases they are timed against, in the listed order, then shared among
    workers as a whole list is; no names keeps every variant."""
    base_of = bench_mods.bases(LISTED)
    assert bench_mods.chosen(LISTED, base_of, None) == LISTED
    picked = bench_mods.chosen(LISTED, base_of, ["8 documents (block mask)", "ALiBi"])
    assert [name for name, _, _ in picked] == ["plain", "ALiBi", "causal (built-in)", "8 documents (block mask)"]
    shares = [[name for name, _, _ in bench_mods.share_of(picked, base_of, (i, 3))] for i in range(3)]
    assert shares == [["plain", "ALiBi"], ["causal (built-in)", "8 documents (block mask)"], []]
