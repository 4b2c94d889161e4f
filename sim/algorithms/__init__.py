"""The schedules `sim` counts: standard attention (Algorithms 0 and 3 of the FlashAttention paper),
FlashAttention-1 (Algorithms 1 and 4) and FlashAttention-2 (its Algorithms 1 and 2).

Each module has ``forward(h, p, blocks, ctx)`` and ``backward(h, p, blocks, ctx)`` that run on a
`sim.hierarchy.Hierarchy` whose HBM already holds the inputs.
"""
