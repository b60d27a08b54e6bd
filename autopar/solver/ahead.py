"""The even split's bounds taken ahead of the search, in a second process.

Once the queue is built (bounded_queue.py), the costliest step left in the search's own process is the
even split's device-by-device bound (bounds.SearchBounds._refine_even: its splits' partitions, then a
knapsack per split), which an interleaved or ZB-V candidate takes when its summed bound reaches the queue's
head. On HF GPT-2 175B over 1,024 GPUs 1,079 candidates take it, about 1 ms each: half of the search after
its queue, on one core of two while the other has nothing left to do (the sharding ILPs' second
process is done by then).

:func:`walk_ahead` forks a process holding the queue as it is. It walks the same queue in the same order
(bounded_queue.BoundedQueue._next, bounds only: it evaluates nothing, so it runs ahead of the search) and
takes the bounds of the candidates whose even splits are *its* (:func:`theirs`: half of the split keys, so
that each process computes its own splits once; given more, it falls behind the search, which then waits or
computes them twice: measured no faster), sending each back; those of the search's own split keys it
passes over. The search takes a bound of theirs from the pipe when it has arrived, checked to be for the same
candidate and summed bound, and computes it itself when it has not. A bound is a pure function of the
candidate and its summed bound, so the plan, every bound and every count are the same with or without the
second process; only the time changes. Without ``fork`` (Windows, macOS by default), inside a daemonic process,
or for a queue of fewer than :data:`MIN_CANDIDATES` candidates (a second process costs more than it saves),
the search computes every bound itself; nor in a process that runs beside others keeping every core busy
(:func:`cores_taken`: autopar.sweep's workers).
"""

from __future__ import annotations

import math
import multiprocessing
import warnings
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .space import Candidate, Key

if TYPE_CHECKING:
    from .search import Search

MIN_CANDIDATES = 20_000   # queued candidates from which a second process pays (HF GPT-2 175B: 280,768)

Bound = Callable[[Candidate, float, tuple], "float | None"]   # SearchBounds._even_bound


def theirs(split_key: tuple) -> bool:
    """Whether the second process takes the bounds of candidates with this even-split key: half of the keys, the
    same ones in every run (a checksum of the key's text, which Python's salted string hash is not)."""
    return zlib.crc32(repr(split_key).encode()) & 1 == 1


@dataclass
class Ahead:
    """The search's side: the second process, the pipe's receiving end, the bounds that have arrived."""

    process: Any
    receiver: Any
    received: dict[Key, tuple[float, float | None]] = field(default_factory=dict)

    def refine(self, split_key: tuple, c: Candidate, lb_t: float, bound: Bound) -> float | None:
        """``bound(c, lb_t, split_key)``, from the second process when it has sent it."""
        if theirs(split_key):
            receiver, received = self.receiver, self.received
            try:
                while receiver.poll():
                    key, summed, tighter = receiver.recv()
                    received[key] = (summed, tighter)
            except (EOFError, OSError):   # the process ended (it fails alone: the search computes the rest)
                pass
            got = received.get(c.sort_key())
            if got is not None and got[0] == lb_t:
                return got[1]
        return bound(c, lb_t, split_key)

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.receiver.close()


@dataclass
class _Walker:
    """The second process's side: computes and sends the bounds of its split keys, passes over the rest."""

    sender: Any

    def refine(self, split_key: tuple, c: Candidate, lb_t: float, bound: Bound) -> float | None:
        if not theirs(split_key):
            return lb_t   # the search's own: left as it is (it leaves the queue at once, as a candidate)
        tighter = bound(c, lb_t, split_key)
        self.sender.send((c.sort_key(), lb_t, tighter))
        return tighter


_CORES_TAKEN = False


def cores_taken() -> None:
    """This process runs beside others that keep every core busy (autopar.sweep's workers, one size each): a
    second process would only take time from them (the sweep bench: 26 s where it took 22 s without)."""
    global _CORES_TAKEN
    _CORES_TAKEN = True


def walk_ahead(search: "Search", queue: list) -> Ahead | None:
    """The second process walking ``queue`` (module docstring), or None where there is none to be had."""
    if (search.settled.total < MIN_CANDIDATES or _CORES_TAKEN or "fork" not in multiprocessing.get_all_start_methods()
            or multiprocessing.current_process().daemon):
        return None
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_walk, args=(search, queue, sender, receiver), name="autopar-bounds-ahead",
                              daemon=True)
    with warnings.catch_warnings():   # Python 3.12+ warns of fork beside threads: the child runs no one's locks
        warnings.simplefilter("ignore", DeprecationWarning)
        process.start()
    sender.close()
    return Ahead(process, receiver)


def _walk(search: "Search", queue: list, sender: Any, receiver: Any) -> None:
    receiver.close()
    search.ahead = _Walker(sender)
    search.progress = False
    if search.layouts_ahead is not None:   # a layout not solved yet is solved here: the prefetch is the search's
        search.layouts_ahead.forget_prefetch()
    try:
        while search._next(queue, math.inf) is not None:
            pass
    finally:
        sender.close()
