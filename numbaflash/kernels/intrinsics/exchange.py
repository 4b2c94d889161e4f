"""How the CUDA simulator emulates collective instructions: threads of a group meet and swap operands.

The simulator runs one Python thread per CUDA thread and knows nothing of warps. A collective (a
shuffle, an mma of a warp, a wgmma of a warpgroup) is emulated by an exchange: each thread of its
group (32 lanes of a warp, or 128 threads of a warpgroup) deposits its operand, the group meets at a
barrier, and each thread reads what the hardware would have routed to it.
"""

import threading

import numpy as np

from . import simulated_blocks

WARP = 32
WARPGROUP = 128

_registry_lock = threading.Lock()


class Meeting:
    """A barrier whose ``threads``-th arrival completes it, ``generation`` counting its completions; an arrival that
    waits sleeps until its generation completes. One notification a generation: threading.Barrier, which fills and
    then drains, notifying at each, took 1.15-1.35x as long over a simulated mma.sync forward (4 heads, seqlen 64,
    headdim 128, causal) and 1.17x over tests/test_staged_reads.py in the exchanges."""

    def __init__(self):
        self.arrived = 0
        self.generation = 0
        self.sleepers = simulated_blocks.Sleepers()  # arrivals waiting for this generation
        self.cond = threading.Condition()

    def arrive(self, threads, wait, waiting):
        """``waiting(still)`` (`simulated_blocks.waiting`'s signature) is told before the arrival sleeps. The block
        counts the arrivals asleep here (`simulated_blocks.Sleepers`), so that a block whose every thread sleeps fails
        instead of hanging."""
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == threads:
                self.arrived = 0
                self.generation += 1
                self.sleepers.wake_all()
                self.cond.notify_all()
            elif wait:
                waiting(lambda: self.generation == generation)
                self.sleepers.add()
                while self.generation == generation:
                    self.cond.wait()


class _Group:
    """Two slot buffers used alternately: one barrier per exchange suffices, because a thread can only
    write buffer n + 2 after barrier n + 1, which every thread passes only after reading buffer n."""

    def __init__(self, size):
        self.size = size
        self.meeting = Meeting()  # its generation: the exchanges the whole group has met at
        self.buffers = ([None] * size, [None] * size)
        self.generation = [0] * size
        self.lock = threading.Lock()
        self.results = [None, None]  # (generation, value) of the last group-wide result per buffer


def _deposit(value, size):
    """Deposit ``value`` in the calling thread's group of ``size`` threads and wait for all of them: every
    thread's values, this thread's rank in the group, the group and the exchange's generation."""
    thread = threading.current_thread()
    rank = thread.thread_id % size
    groups = thread.__dict__.setdefault("_numbaflash_groups", {})
    group = groups.get(size)
    if group is None:  # first exchange of this simulated thread at this size: find or make its group
        manager = thread._manager  # the simulator's BlockManager: one per running thread block
        group_id = thread.thread_id // size
        with _registry_lock:
            registry = manager.__dict__.setdefault("_numbaflash_groups", {})
            if (size, group_id) not in registry:
                block_threads = int(np.prod(manager._block_dim))
                registry[size, group_id] = _Group(min(size, block_threads - size * group_id))
            group = groups[size] = registry[size, group_id]
    generation = group.generation[rank]
    slots = group.buffers[generation % 2]
    group.generation[rank] += 1
    slots[rank] = value
    group.meeting.arrive(group.size, True, simulated_blocks.collective_waiting)  # its last thread may be held
    simulated_blocks.woke()
    return slots, rank, group, generation


def exchange(value, size=WARP):
    """All threads of the calling thread's group deposit ``value``; each gets every thread's value and its rank."""
    slots, rank, _, _ = _deposit(value, size)
    return slots, rank


def group_result(value, compute, size=WARP):
    """Exchange ``value``; ``compute(values of all threads)`` runs once per group and every thread gets its
    result and its rank (a thread reads it before it can reach the exchange after next, which would reuse
    the slot)."""
    slots, rank, group, generation = _deposit(value, size)
    with group.lock:
        done = group.results[generation % 2]
        if done is None or done[0] != generation:
            done = group.results[generation % 2] = (generation, compute(slots))
    return done[1], rank
