"""The CUDA kernels, their device-side building blocks, and the cache that compiles them.

The mask bounds of `numbaflash.masks` are registered here as device functions, so every kernel calls
the same code the reference and `sim` use.
"""

from .. import masks
from .intrinsics import device_function

for _bound in (masks.key_range, masks.block_key_range, masks.tile_is_full, masks.query_range, masks.visible_pair):
    device_function(_bound)
