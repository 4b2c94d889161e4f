"""A thread block manager for Numba's CUDA simulator that waits instead of polling.

The simulator runs one Python thread per CUDA thread, and its `BlockManager` finds the threads that reached
``syncthreads`` by looping over all of them until the block ends: a thread that always wants the interpreter
lock, so every simulated thread shares the CPU with it. `WaitingBlockManager` keeps the same semantics
(``syncthreads`` releases the block once every thread still running has reached it; the first exception
aborts the others and is raised) with a condition variable: the last thread to arrive releases the others,
and the manager sleeps until the block ends. `install` puts it in the simulator; `kernels.intrinsics` installs it
whenever the simulator is on. `producer_last` holds a producer warpgroup after each wait until the rest of its
block waits, `consumers_last` the other warpgroups (tests/test_staged_reads.py), through the emulated waits'
`waiting` and `passed`. Each block's threads take the launching thread's NumPy floating-point error handling
(``np.errstate``), which threads do not inherit: `compiled.Kernel.launch` runs numbaflash's kernels without warnings,
as the hardware's arithmetic raises none.

On this project's 2-core CPU machine the CI suite ran in 470 s against 793 s, and one test alone 2.4-4x faster
(tests/test_forward.py::test_wgmma_forward_matches_reference 55.9 -> 13.6 s, in one process). The polling manager
needed Python's switch interval lowered to 0.3 ms while a kernel ran; this one runs fastest at the default 5 ms
(the same test: 22.5 s at 0.3 ms, 15.2 at 1 ms, 13.6-14.2 at 5 ms, 15.0 at 20 ms).
"""

import contextlib
import threading

import numpy as np
from numba.cuda.simulator import kernel as simulator

_held = None  # which warpgroups hold after their waits: "producer" (`producer_last`), "consumers" (`consumers_last`)


class _BlockState:
    """What a block's threads share: how many still run, how many wait at ``syncthreads``, the barrier's
    generation, and the first thread that failed."""

    def __init__(self, threads):
        self.cond = threading.Condition()
        self.live = threads
        self.live_first = min(threads, 128)  # of the first warpgroup (`consumers_last`)
        self.waiting = 0
        self.sleeping = 0  # threads asleep in a collective, a named barrier or an mbarrier wait (`Sleepers`)
        self.generation = 0
        self.failed = None
        self.waits = {}  # thread -> True while the emulated wait it sits in cannot pass (`waiting`)
        self.releases = 0  # how many times the threads holding after their waits went on (`passed`)

    def release_if_all_wait(self):
        """With ``cond`` held: release ``syncthreads`` when every running thread waits there."""
        if self.waiting and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()

    def deadlock(self):
        """With ``cond`` held: why the block can never go on, or None. Every running thread sleeps, at
        ``syncthreads`` (not all of them, or it would release) or in collectives, named barriers and mbarrier waits,
        which only other threads' arrivals complete: on the GPU the block hangs (a shuffle called by part of a warp,
        a barrier some threads skip, a stage no copy fills). A thread between two tries of an mbarrier wait counts
        as running, so such a hang is seen once every waiter is inside a try at once."""
        if 0 < self.live and self.waiting < self.live and self.waiting + self.sleeping == self.live:
            return (f"the simulated block can never go on: {self.waiting} of its {self.live} running threads wait at "
                    f"syncthreads and {self.sleeping} in warp collectives, named barriers or mbarrier waits that only "
                    "other threads complete (a collective called by part of a warp, a barrier some threads skip, or "
                    "a wait no arrival ends?)")
        return None


class WaitingThread(simulator.BlockThread):
    """A simulated thread whose ``syncthreads`` waits on its block's condition variable."""

    def run(self):
        super().run()  # an exception is kept in self.exception
        block = self._manager.state
        with block.cond:
            block.live -= 1
            block.live_first -= self.threadIdx.x < 128
            block.release_if_all_wait()
            why = block.deadlock()
            if why is not None and self.exception is None:
                self.exception = (RuntimeError(why), None)
            if self.exception is not None and block.failed is None:
                block.failed = self
            block.cond.notify_all()  # the manager waits for the last thread or the first failure

    def syncthreads(self):
        block = self._manager.state
        with block.cond:
            if block.failed is not None:
                raise RuntimeError("abort flag set on syncthreads call")
            generation = block.generation
            block.waiting += 1
            block.release_if_all_wait()
            why = block.deadlock()
            if why is not None:
                raise RuntimeError(why)
            if _held is not None:  # a thread held after its wait counts this one as waiting (`passed`)
                block.waits[self] = lambda: block.generation == generation
            block.cond.wait_for(lambda: block.generation != generation or block.failed is not None)
            block.waits.pop(self, None)
            if block.failed is not None:
                raise RuntimeError("abort flag set on syncthreads clear")


class WaitingBlockManager(simulator.BlockManager):
    """`simulator.BlockManager` whose ``run`` sleeps until its threads end or one fails."""

    def run(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        self.state = _BlockState(len(points))
        errors = np.geterr()  # NumPy keeps it per thread, and a new thread starts from the defaults

        def target():
            with np.errstate(**errors):
                self._f(*args)

        threads = [WaitingThread(target, self, grid_point, point, self._debug) for point in points]
        for t in threads:
            t.start()
        state = self.state
        with state.cond:
            state.cond.wait_for(lambda: state.live == 0 or state.failed is not None)
            failed = state.failed
        if failed is not None:
            # as the simulator does: the other threads are told to abort and not joined, so that a debugger
            # finds them where they were
            for t in threads:
                t.abort = True
            raise failed.exception[0].with_traceback(failed.exception[1])


@contextlib.contextmanager
def _holding(who):
    global _held
    _held = who
    try:
        yield
    finally:
        _held = None


def producer_last():
    """Within it, a thread of a block's first warpgroup (v4's and v5's producer) that passes an emulated wait holds
    until every other running thread of its block waits too: the consumers then reach each tile before the copies
    and stores that fill it. A consumer that reads staged data before the wait that lands it reads the stage's
    last fill (so the v5 dK/dV consumers read the staged ALiBi slope, which racecheck found on the H200 and the
    simulator's free-running threads did not); blocks of one warpgroup run as they do without it."""
    return _holding("producer")


def consumers_last():
    """`producer_last`'s mirror: a thread of the other warpgroups holds after each wait until every running thread
    of the first warpgroup waits, so the producer refills each stage as soon as it is released, and a consumer that
    reads a stage after releasing it reads the next fill."""
    return _holding("consumers")


def _thread_state():
    thread = threading.current_thread()
    return thread, (thread._manager.state if isinstance(thread, WaitingThread) else None)


def waiting(still):
    """An emulated wait (an mbarrier's, a named barrier's) is about to sleep: ``still()`` is True while it cannot
    pass."""
    if _held is None:  # no thread asks (a lock per spin of every wait otherwise)
        return
    thread, state = _thread_state()
    if state is not None:
        with state.cond:
            state.waits[thread] = still


def collective_waiting(still):
    """`waiting` for a collective's wait (`exchange`): counted for a producer thread under `producer_last` only,
    where its group may wait for a thread held after its wait. A consumer's collective waits for no held thread,
    and counted as a wait it let the producer go on while the consumers were inside a tile (the staged slope's read
    before its wait then found the new slope, and the test passed)."""
    if _held == "producer" and threading.current_thread().threadIdx.x < 128:
        waiting(still)


def _asleep(delta):
    """``delta`` more (or fewer) of the calling thread's block sleep; the one that falls asleep while every other
    running thread sleeps fails (`_BlockState.deadlock`)."""
    _, state = _thread_state()
    if state is None:
        return
    with state.cond:
        state.sleeping += delta
        why = state.deadlock() if delta > 0 else None
    if why is not None:
        raise RuntimeError(why)


class Sleepers:
    """The threads asleep on one barrier (a collective's or named barrier's `exchange.Meeting`, an mbarrier's phase in
    `emulated_hopper`), counted in their block's so that a block whose every thread sleeps fails instead of hanging.
    Called with the barrier's lock held; its completion takes them all off before its thread goes on, so no woken
    thread counts as asleep while the others check."""

    def __init__(self):
        self.count = 0

    def add(self):
        self.count += 1
        _asleep(1)

    def remove(self):
        """One that woke without the barrier's completion (an mbarrier try's short wait ran out)."""
        self.count -= 1
        _asleep(-1)

    def wake_all(self):
        if self.count:
            _asleep(-self.count)
            self.count = 0


def woke():
    """An emulated collective's wait (`exchange`) has passed: `passed`, without holding."""
    passed(hold=False)


def passed(hold=True):
    """An emulated wait has passed; under `producer_last` a thread of the first warpgroup holds here until every
    other running thread waits or holds, under `consumers_last` a thread of the others until the first's wait."""
    if _held is None:
        return
    thread, state = _thread_state()
    if state is None:
        return
    with state.cond:
        state.waits.pop(thread, None)
        producer = thread.threadIdx.x < 128
        if not hold or thread._manager._block_dim[0] <= 128 or producer != (_held == "producer"):
            return
        state.waits[thread] = _always  # to the other threads holding here, this one waits
        if producer:  # until every other thread waits (or holds)
            held = lambda: sum(1 for still in state.waits.values() if still()) >= state.live
        else:  # until the producer waits: holding until every other thread did serialized the consumers
            held = lambda: sum(1 for t, still in state.waits.items() if t.threadIdx.x < 128 and still()) >= (
                state.live_first)
        release = state.releases
        while state.releases == release and not held() and state.failed is None:
            state.cond.wait(0.002)  # polled: neither a wait's start nor a barrier's completion notifies this one
        if state.releases == release:  # every thread holding goes on together (one by one, 256 took 5x as long)
            state.releases += 1
            state.cond.notify_all()
        state.waits.pop(thread, None)


def _always():
    return True


def install():
    """Make the simulator run thread blocks with `WaitingBlockManager`."""
    simulator.BlockManager = WaitingBlockManager
