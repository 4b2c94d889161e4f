"""`sim`: a simulated HBM + SRAM hierarchy that counts the memory traffic of attention schedules.

``count_io(...)`` runs standard attention, FlashAttention-1 or FlashAttention-2 (forward or backward)
tile by tile, charges every element moved between HBM and an SRAM of fixed capacity, and checks the
counts against each schedule's closed form and the result against the float64 reference.
"""

from . import hardware
from .api import ALGORITHMS, Report, SimulationMismatch, count_io, predict_io
from .blocks import Blocks, min_sram
from .hierarchy import SramOverflow

__all__ = ["ALGORITHMS", "hardware", "Blocks", "Report", "SimulationMismatch", "SramOverflow", "count_io", "min_sram", "predict_io"]
