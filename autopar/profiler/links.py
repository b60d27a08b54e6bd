r"""Link profiling: time the collectives on this machine's ranks and fit the alpha-beta model.

**What is measured.** :func:`measure_links` spawns ``n`` local ranks once (gloo on CPU, NCCL with
one GPU per rank) and times, for every per-rank size ``S`` in bytes (float32 buffers; ``S`` has
the meaning of cost_model/comm.py: all-reduce the buffer, all-gather the OUTPUT,
reduce-scatter the INPUT, all-to-all the send buffer, p2p the message):

* ``all_reduce``, ``all_gather`` (into one tensor), ``reduce_scatter`` (from one tensor),
  ``all_to_all`` (``all_to_all_single``) over all ``n`` ranks;
* ``p2p``: ranks 0 and 1 play ping-pong (0 sends, 1 receives and sends back); the one-way
  time is half the round trip, which needs no clock shared between the two ranks.

One repeat of a (collective, size) is: a barrier, then ``k`` back-to-back calls, each timed
with ``time.perf_counter`` (CUDA: a synchronisation before the clock stops). ``k`` is the same
on every rank and makes a repeat last about :data:`BLOCK_SECONDS` (from the slowest rank's
fastest warm-up call; ``k = 1`` for large messages), so that small messages get many timings
and the barrier's exit skew touches only the first of them. Every call's time is the MAX over
ranks (a collective ends when its last rank is done; one all-reduce(MAX) of all the times at
the end), and the sample is the MEAN over all timed calls of all repeats: a training step is a
sum of many collectives, so what it pays per call is the mean, stalls (below) included. Every repeat visits
the (collective, size) pairs in a new order, the same on every rank, so that a burst of load on
the machine hits one repeat of many sizes rather than every repeat of one size. All calls work
on views of two buffers of the largest size, allocated once.

Gloo's ``reduce_scatter_tensor`` (torch 2.13) is supported but is NOT a ring reduce-scatter:
ProcessGroupGloo clones the input, all-reduces all of it and copies this rank's chunk out,
so it costs about an all-reduce of ``S``. The profile records what the backend really does;
its fit then gives a (low) effective ``B`` for reduce-scatter that the cost model uses as is.

The same spawn measures the **DTensor dispatch overhead** of autopar's runtime: the op mix of
a tensor-parallel layer at a negligible size (a linear whose weight is ``Shard(0)``, gelu, two
views, two transposes, a multiply, a sum), exported and run node by node through the runtime's
``NodeRunner``, on plain tensors and on DTensors of a 1-D mesh of all ranks, forward and
forward + backward. Per node,

    fwd = (t_DT(forward) - t_plain(forward)) / nodes
    bwd = ([t_DT(fb) - t_plain(fb)] - [t_DT(forward) - t_plain(forward)]) / nodes

Each ``t`` is the median over :data:`DISPATCH_BLOCKS` blocks of 50-200 calls, the plain and DTensor
blocks alternating; the MAX over ranks is reported, and a difference below 0 (timing noise) as 0.
(A replicated ``x + y`` alone costs a fraction of this: sharding propagation of views and
sharded matmuls, and the runtime's wrapping of every value, are what cost.)

**Noise.** On a small VM gloo's times are bimodal: most calls take the link's time, but a
fraction (0-60%, varying with size and over time, even on an idle machine) waits for a
scheduler tick (4 ms at HZ=250) in one of the many thread hand-offs of a gloo collective. A
median would price a collective at the fast mode and a step full of collectives far below
what it measures (the 2 MB all-reduces of a tensor-parallel step cost ~4 ms each in context
against a 1.5 ms median); the mean prices the stalls at their frequency, and, being about
the same for every size, they mostly land in ``alpha``. bench/link_fit.py shows how far the fit
then predicts sizes it did not see.

**The fit.** Every collective is fitted by ``t(S) = alpha + beta * S`` minimising the
RELATIVE error, i.e. weighted least squares with weights ``1 / t_i``:

    min_{alpha, beta >= 0}  sum_i ((alpha + beta * S_i - t_i) / t_i)^2
                          = || A x - 1 ||^2,   A_i = [1 / t_i, S_i / t_i],  x = (alpha, beta).

The objective is a convex quadratic, so its minimum over the quadrant ``alpha, beta >= 0`` is
the unconstrained least-squares solution when it is feasible, else the better of the two
edge minima (``alpha = 0`` or ``beta = 0``, each a one-variable least squares clipped at 0).

**Two segments.** A backend may switch protocol at some size (NCCL's LL/LL128/Simple; gloo's
all-gather and reduce-scatter allocate a message-sized buffer per call, which glibc maps afresh,
and so page-faults in, from 32 MiB on), so one line cannot fit both ends of the range. :func:`fit_collective` also
tries every split of the sorted sizes into a small and a large segment of at least
:data:`MIN_SEGMENT` sizes each, fits each segment by the line above, and keeps the split with
the least trimmed loss ``sum_i min(r_i^2, c^2)`` (``r_i`` the relative errors, ``c`` =
:data:`OUTLIER_REL_ERROR`) when that loss is below the single line's divided by
:data:`PIECEWISE_GAIN`: two more parameters must earn their keep, and a sample the machine
stalled (see Noise) counts no more than one just ``c`` off, so it cannot pick the model alone.
Samples more than ``c`` off the chosen fit are listed in ``outliers``. ``small`` prices sizes up
to its largest measured size, ``large`` sizes from its smallest on, and a size in between gets
the faster of the two lines (a backend with two protocols picks the faster one; NCCL's tuner
models the same way).

**Conversion to the cost model** (:func:`to_link`). For a ring of ``n`` ranks on one node
(comm.py), with ``a`` the seconds per ring step and ``B`` the bytes/s of one rank's link:

* all-reduce:                         ``alpha = 2(n-1) a``,  ``beta = 2(n-1)/n / B``
* all-gather, reduce-scatter, all-to-all: ``alpha = (n-1) a``,  ``beta = (n-1)/n / B``
* p2p:                                ``alpha = a``,         ``beta = 1 / B``

so ``a`` and ``B`` follow from each fitted line. A two-segment fit gives ``B`` from its
large-message segment (bandwidth-bound) and ``a`` from its small-message segment
(latency-bound). When the large segment is a slow-down rather than a faster protocol (gloo's
all-gather and reduce-scatter past 32 MiB), that ``B`` overprices the smaller messages: the
default sizes stop at 24 MiB for that reason. The Link's own ``bandwidth`` and ``latency`` are
the all-reduce's ``B`` and ``a`` (efficiency 1: measured figures are achieved figures);
broadcast, not measured, falls back to them.

SI units throughout: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..cluster import CollectiveFit, Link
from ..errors import ConfigError, RuntimeFailure
from .host import check_threads, progress as progress_bar

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""The collectives :func:`measure_links` times, named as in ``autopar.cluster.COLLECTIVE_NAMES``."""

DEFAULT_SIZES: tuple[int, ...] = tuple(int(s) for s in np.geomspace(2 ** 10, 24 * 2 ** 20, 16))
"""Per-rank bytes measured by default: 16 sizes log-spaced from 1 KiB to 24 MiB (below the 32 MiB
from which gloo's all-gather and reduce-scatter slow down, see "Two segments")."""

BLOCK_SECONDS = 2e-3
"""One repeat's back-to-back calls last about this long (one call when a call is longer)."""
MAX_CALLS_PER_BLOCK = 32
"""The most calls one repeat times."""
DISPATCH_BLOCKS = 21
"""Blocks the dispatch overhead is the median over (per variant)."""
MIN_SEGMENT = 3
"""Sizes each segment of a two-segment fit needs at least."""
PIECEWISE_GAIN = 2.0
"""A two-segment fit is kept when its trimmed loss is below the line's divided by this (two more
parameters must earn their keep: roughly an F-test at 5% for 10-20 sizes)."""
OUTLIER_REL_ERROR = 0.3
"""A sample this far (relative) from a fit is an outlier: it counts as if just this far when fits
are compared (the trimmed loss), so one stalled sample cannot pick the model."""

_FLOAT_BYTES = 4


# --- The profile ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """Measured collective times of ``nprocs`` local ranks and the DTensor dispatch overhead."""

    backend: str
    """"gloo" or "nccl"."""
    nprocs: int
    """Ranks that took part (the group size ``n`` of every collective but p2p)."""
    threads_per_rank: int
    """``torch.set_num_threads`` of every rank."""
    samples: Mapping[str, tuple[tuple[int, float], ...]]
    """Collective name -> ((per-rank bytes, seconds), ...) in increasing bytes. Stored read-only."""
    dispatch_fwd_seconds: float
    """Extra seconds per op of a forward run on Replicate DTensors instead of plain tensors."""
    dispatch_bwd_seconds: float
    """Extra seconds per op of the backward of those ops."""
    overlap_fraction: float
    """Fraction of an asynchronous all-reduce's time that compute issued meanwhile hides (0..1)."""
    context_seconds: Mapping[str, float]
    """Extra seconds per call of a collective issued right after compute, over back-to-back calls
    ("all_reduce" for the ring collectives, "p2p"); stored read-only."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"LinkProfile.backend={self.backend!r} must be 'gloo' or 'nccl'")
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 2:
            raise ConfigError(f"LinkProfile.nprocs={self.nprocs!r} must be an integer >= 2")
        check_threads(self.threads_per_rank)
        clean: dict[str, tuple[tuple[int, float], ...]] = {}
        for kind, pairs in self.samples.items():
            if kind not in COLLECTIVES:
                raise ConfigError(f"LinkProfile.samples has unknown collective {kind!r}; known: {list(COLLECTIVES)}")
            clean[kind] = _check_samples(kind, pairs)
        object.__setattr__(self, "samples", MappingProxyType(clean))
        if isinstance(self.overlap_fraction, bool) or not isinstance(self.overlap_fraction, (int, float)) \
                or not 0 <= self.overlap_fraction <= 1:
            raise ConfigError(f"LinkProfile.overlap_fraction={self.overlap_fraction!r} must be a number in [0, 1]")
        context = dict(self.context_seconds)
        if set(context) != {"all_reduce", "p2p"} or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                for v in context.values()):
            raise ConfigError(f"LinkProfile.context_seconds={context!r} must map 'all_reduce' and 'p2p' to "
                              "seconds >= 0")
        object.__setattr__(self, "context_seconds", MappingProxyType(context))
        for name in ("dispatch_fwd_seconds", "dispatch_bwd_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"LinkProfile.{name}={value!r} must be a finite number of seconds >= 0")

    def __hash__(self) -> int:
        return hash((self.backend, self.nprocs, self.threads_per_rank, tuple(sorted(self.samples.items())),
                     self.dispatch_fwd_seconds, self.dispatch_bwd_seconds, self.overlap_fraction,
                     tuple(sorted(self.context_seconds.items()))))

    @property
    def key(self) -> str:
        """The ProfileDB key of this profile in section "links", e.g. "gloo x2"."""
        return links_key(self.backend, self.nprocs)

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable record with units in the field names (for ProfileDB section "links")."""
        return {"backend": self.backend, "nprocs": self.nprocs, "threads_per_rank": self.threads_per_rank,
                "collectives": {kind: {"bytes": [b for b, _ in pairs], "seconds": [t for _, t in pairs]}
                                for kind, pairs in self.samples.items()},
                "dispatch_fwd_seconds": self.dispatch_fwd_seconds,
                "dispatch_bwd_seconds": self.dispatch_bwd_seconds, "overlap_fraction": self.overlap_fraction,
                "context_seconds": dict(self.context_seconds)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "LinkProfile":
        """The profile :meth:`to_record` wrote; ConfigError when a field is missing or malformed."""
        needed = ("backend", "nprocs", "threads_per_rank", "collectives", "dispatch_fwd_seconds",
                  "dispatch_bwd_seconds", "overlap_fraction", "context_seconds")
        missing = [k for k in needed if k not in record]
        if missing:
            raise ConfigError(f"link profile record lacks {missing}: measure the links again (measure_links)")
        collectives = record["collectives"]
        if not isinstance(collectives, Mapping):
            raise ConfigError(f"link profile record 'collectives'={collectives!r} must map a collective to "
                              "{'bytes': [...], 'seconds': [...]}")
        samples = {}
        for kind, columns in collectives.items():
            if not isinstance(columns, Mapping) or set(columns) != {"bytes", "seconds"} \
                    or len(columns["bytes"]) != len(columns["seconds"]):
                raise ConfigError(f"link profile record of {kind!r} must be {{'bytes': [...], 'seconds': [...]}} "
                                  "with lists of equal length")
            samples[kind] = tuple(zip(columns["bytes"], columns["seconds"]))
        return cls(backend=record["backend"], nprocs=record["nprocs"], threads_per_rank=record["threads_per_rank"],
                   samples=samples, dispatch_fwd_seconds=record["dispatch_fwd_seconds"],
                   dispatch_bwd_seconds=record["dispatch_bwd_seconds"],
                   overlap_fraction=record["overlap_fraction"], context_seconds=record["context_seconds"])


def links_key(backend: str, nprocs: int) -> str:
    """ProfileDB key of the links measured with ``backend`` over ``nprocs`` ranks: "<backend> x<ranks>"."""
    return f"{backend} x{nprocs}"


def _check_samples(kind: str, pairs: Sequence[Sequence[float]]) -> tuple[tuple[int, float], ...]:
    out = []
    for pair in pairs:
        if len(pair) != 2:
            raise ConfigError(f"sample {pair!r} of {kind!r} must be a (bytes, seconds) pair")
        nbytes, seconds = pair
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise ConfigError(f"sample {pair!r} of {kind!r}: bytes must be an integer >= 1")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ConfigError(f"sample {pair!r} of {kind!r}: seconds must be a finite number > 0")
        out.append((int(nbytes), float(seconds)))
    return tuple(sorted(out))


# --- Fitting ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LineFit:
    """``t = alpha + beta * S`` on some range of sizes."""

    alpha: float
    """Seconds at zero bytes (>= 0)."""
    beta: float
    """Seconds per byte (>= 0)."""

    def predict(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True, kw_only=True)
class CollectiveFitResult:
    """The fit of one collective's samples: one line, or two segments (module docstring: two segments)."""

    small: LineFit
    """The line up to ``small_max_bytes`` (every size when the fit is one line)."""
    large: LineFit
    """The line from ``large_min_bytes`` on (the same line as ``small`` when the fit is one line)."""
    small_max_bytes: float = math.inf
    """The largest measured size of the small segment; ``math.inf`` for one line."""
    large_min_bytes: float = math.inf
    """The smallest measured size of the large segment; ``math.inf`` for one line."""
    median_rel_error: float = 0.0
    """Median over the fitted samples of ``|t_fit - t| / t``."""
    max_rel_error: float = 0.0
    """Maximum over the fitted samples of ``|t_fit - t| / t``."""
    outliers: tuple[int, ...] = ()
    """Sizes (bytes) whose sample is more than :data:`OUTLIER_REL_ERROR` off the fit."""

    @property
    def piecewise(self) -> bool:
        return math.isfinite(self.small_max_bytes)

    @property
    def alpha(self) -> float:
        """Seconds of latency: the small-message segment's intercept."""
        return self.small.alpha

    @property
    def beta(self) -> float:
        """Seconds per byte: the large-message segment's slope."""
        return self.large.beta

    def predict(self, nbytes: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """Seconds predicted for per-rank ``nbytes`` (array in, array out); between the segments'
        measured ranges, the faster of the two lines."""
        s = np.asarray(nbytes, dtype=float)
        small, large = self.small.predict(s), self.large.predict(s)
        return np.where(s <= self.small_max_bytes, small,
                        np.where(s >= self.large_min_bytes, large, np.minimum(small, large)))


def _relative_lstsq(s: np.ndarray, t: np.ndarray) -> LineFit:
    """``alpha, beta >= 0`` minimising ``sum(((alpha + beta s - t) / t)^2)`` (see the module docstring)."""
    a = np.column_stack([1.0 / t, s / t])
    ones = np.ones_like(t)
    candidates = []
    x, *_ = np.linalg.lstsq(a, ones, rcond=None)
    if x[0] >= 0 and x[1] >= 0:
        candidates.append(x)
    for col in (0, 1):  # the other parameter pinned at 0
        c = a[:, col]
        x = np.zeros(2)
        x[col] = max(0.0, float(c @ ones / (c @ c)))
        candidates.append(x)
    best = min(candidates, key=lambda x: float(np.sum((a @ x - ones) ** 2)))
    return LineFit(alpha=float(best[0]), beta=float(best[1]))


def _trimmed_loss(residuals: np.ndarray) -> float:
    """``sum(min(r^2, c^2))``: an outlier costs as much as a sample just at the threshold ``c``."""
    return float(np.sum(np.minimum(residuals ** 2, OUTLIER_REL_ERROR ** 2)))


def _finish(fit: CollectiveFitResult, s: np.ndarray, t: np.ndarray) -> tuple[CollectiveFitResult, float]:
    """``fit`` with its errors and outliers on ``(s, t)`` filled in, and its trimmed loss."""
    r = (fit.predict(s) - t) / t
    out = np.abs(r) > OUTLIER_REL_ERROR
    done = CollectiveFitResult(small=fit.small, large=fit.large, small_max_bytes=fit.small_max_bytes,
                               large_min_bytes=fit.large_min_bytes, median_rel_error=float(np.median(np.abs(r))),
                               max_rel_error=float(np.abs(r).max()),
                               outliers=tuple(int(b) for b in s[out]))
    return done, _trimmed_loss(r)


def _as_arrays(samples: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    pairs = sorted((float(b), float(t)) for b, t in samples)
    if len({b for b, _ in pairs}) < 2:
        raise ConfigError(f"a fit needs samples at 2 or more distinct sizes, got {pairs!r}: measure more sizes")
    s, t = (np.array(col) for col in zip(*pairs))
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ConfigError(f"samples {pairs!r} must have finite bytes > 0 and seconds > 0")
    return s, t


def fit_line(samples: Sequence[tuple[float, float]]) -> CollectiveFitResult:
    """One line ``t = alpha + beta * S`` through ``(bytes, seconds)`` samples, least relative error."""
    s, t = _as_arrays(samples)
    line = _relative_lstsq(s, t)
    return _finish(CollectiveFitResult(small=line, large=line), s, t)[0]


def fit_collective(samples: Sequence[tuple[float, float]], *, piecewise: bool = True) -> CollectiveFitResult:
    """Fit ``(bytes, seconds)`` samples of one collective (module docstring: the fit, two segments).

    With ``piecewise=False``, or fewer than ``2 * MIN_SEGMENT`` distinct sizes, always one line.
    """
    s, t = _as_arrays(samples)
    line = _relative_lstsq(s, t)
    one, line_loss = _finish(CollectiveFitResult(small=line, large=line), s, t)
    best, best_loss = one, line_loss
    if not piecewise or len(np.unique(s)) < 2 * MIN_SEGMENT:
        return one
    for cut in range(MIN_SEGMENT, len(s) - MIN_SEGMENT + 1):
        if s[cut - 1] == s[cut] or len(np.unique(s[:cut])) < 2 or len(np.unique(s[cut:])) < 2:
            continue
        two = CollectiveFitResult(small=_relative_lstsq(s[:cut], t[:cut]), large=_relative_lstsq(s[cut:], t[cut:]),
                                  small_max_bytes=float(s[cut - 1]), large_min_bytes=float(s[cut]))
        candidate, loss = _finish(two, s, t)
        if loss < best_loss:
            best, best_loss = candidate, loss
    return best if best_loss * PIECEWISE_GAIN < line_loss else one


def fit_profile(profile: LinkProfile, *, piecewise: bool = True) -> dict[str, CollectiveFitResult]:
    """:func:`fit_collective` of every collective of ``profile``."""
    return {kind: fit_collective(pairs, piecewise=piecewise) for kind, pairs in profile.samples.items()}


@dataclass(frozen=True, kw_only=True)
class HeldoutError:
    """Relative errors of a fit at sizes it did not see."""

    median_rel_error: float
    max_rel_error: float
    fit: CollectiveFitResult
    """The fit on the kept sizes."""
    heldout: tuple[tuple[int, float, float], ...]
    """(bytes, measured seconds, predicted seconds) at each held-out size."""


def heldout_errors(profile: LinkProfile, every: int = 2, *, piecewise: bool = True) -> dict[str, HeldoutError]:
    """Fit each collective on every ``every``-th size (the 1st, (every+1)-th, ...) and predict the others."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise ConfigError(f"every={every!r} must be an integer >= 2 (every=2 holds out every other size)")
    out = {}
    for kind, pairs in profile.samples.items():
        kept = [p for i, p in enumerate(pairs) if i % every == 0]
        held = [p for i, p in enumerate(pairs) if i % every != 0]
        if len(kept) < 2 or not held:
            raise ConfigError(f"{kind} has {len(pairs)} sizes: holding out all but every {every}th leaves "
                              f"{len(kept)} to fit and {len(held)} to check; measure more sizes")
        fit = fit_collective(kept, piecewise=piecewise)
        s = np.array([b for b, _ in held], dtype=float)
        t = np.array([x for _, x in held])
        pred = fit.predict(s)
        err = np.abs(pred - t) / t
        out[kind] = HeldoutError(median_rel_error=float(np.median(err)), max_rel_error=float(err.max()), fit=fit,
                                 heldout=tuple((b, x, float(p)) for (b, x), p in zip(held, pred)))
    return out


# --- Conversion to the cost model ------------------------------------------------------------------
def ring_factors(kind: str, n: int) -> tuple[float, float]:
    """``(steps, traffic)`` with ``alpha = steps * a`` and ``beta = traffic / B`` for a one-node ring of ``n``."""
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if kind == "p2p":
        return 1.0, 1.0
    raise ConfigError(f"no ring formula for collective {kind!r}; known: {list(COLLECTIVES)}")


def collective_fit(kind: str, fit: CollectiveFitResult, n: int) -> CollectiveFit:
    """The ring model's ``a`` (seconds per step) and ``B`` (bytes/s) of one fitted collective on ``n`` ranks."""
    steps, traffic = ring_factors(kind, n)
    if fit.beta <= 0:
        raise ConfigError(f"the {kind} fit has beta = 0 s/byte (time does not grow with size): measure it up to "
                          "larger sizes so the bandwidth can be fitted")
    return CollectiveFit(latency=fit.alpha / steps, bandwidth=traffic / fit.beta)


def to_link(profile_or_fits: LinkProfile | Mapping[str, CollectiveFitResult], nprocs: int,
            name: str = "shm") -> Link:
    """A Link whose ``collectives`` price every measured collective as the ring model of comm.py.

    ``nprocs`` is the number of ranks the samples were measured on (it must equal a profile's
    ``nprocs``). The Link's ``bandwidth`` and ``latency`` are the all-reduce's ``B`` and ``a``.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 2:
        raise ConfigError(f"nprocs={nprocs!r} must be the integer >= 2 number of ranks the links were measured on")
    if isinstance(profile_or_fits, LinkProfile):
        if profile_or_fits.nprocs != nprocs:
            raise ConfigError(f"the profile was measured on {profile_or_fits.nprocs} ranks, not nprocs={nprocs}: "
                              f"pass nprocs={profile_or_fits.nprocs}, or measure the links on {nprocs} ranks")
        fits = fit_profile(profile_or_fits)
    else:
        fits = dict(profile_or_fits)
    if "all_reduce" not in fits:
        raise ConfigError(f"to_link needs an all_reduce fit (it sets the Link's bandwidth and latency); got "
                          f"{sorted(fits)}")
    collectives = {kind: collective_fit(kind, fit, nprocs) for kind, fit in fits.items()}
    ar = collectives["all_reduce"]
    return Link(bandwidth=ar.bandwidth, latency=ar.latency, efficiency=1.0, name=name, collectives=collectives)


# --- Measuring -------------------------------------------------------------------------------------
def round_sizes(sizes: Sequence[int], nprocs: int) -> tuple[int, ...]:
    """Per-rank bytes rounded to the nearest multiple of ``4 * nprocs`` (at least one), sorted, unique."""
    quantum = _FLOAT_BYTES * nprocs
    out = set()
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"size {size!r} must be an integer number of bytes >= 1")
        out.add(max(1, round(int(size) / quantum)) * quantum)
    return tuple(sorted(out))


def _pick_backend(backend: str | None, nprocs: int) -> str:
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r} is not supported: use 'gloo' (CPU) or 'nccl' (CUDA), or None")
    if backend == "nccl":
        if not cuda:
            raise ConfigError("backend='nccl' needs CUDA, which is not available: use backend='gloo'")
        if torch.cuda.device_count() < nprocs:
            raise ConfigError(f"nprocs={nprocs} NCCL ranks need one GPU each but {torch.cuda.device_count()} are "
                              f"visible: use nprocs <= {torch.cuda.device_count()}")
    return backend


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_links(nprocs: int, threads_per_rank: int = 1, *, sizes: Sequence[int] | None = None, warmup: int = 2,
                  repeats: int = 5, backend: str | None = None, progress: bool = True) -> LinkProfile:
    """Time every collective of :data:`COLLECTIVES` at every size, and the DTensor dispatch overhead,
    on ``nprocs`` local ranks spawned once (module docstring: what is measured).

    ``sizes``: per-rank bytes (default :data:`DEFAULT_SIZES`), rounded by :func:`round_sizes`.
    ``backend``: None picks NCCL when CUDA is available (one GPU per rank), else gloo.
    On a CPU, ``nprocs * threads_per_rank`` above the core count oversubscribes the cores and
    the times say more about the scheduler than the link.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 2:
        raise ConfigError(f"nprocs={nprocs!r} must be an integer >= 2 (p2p needs two ranks)")
    check_threads(threads_per_rank)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1 \
            or isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"repeats={repeats!r} must be an integer >= 1 and warmup={warmup!r} an integer >= 0")
    backend = _pick_backend(backend, nprocs)
    sizes = round_sizes(DEFAULT_SIZES if sizes is None else sizes, nprocs)
    if not sizes:
        raise ConfigError("sizes is empty: give at least one per-rank size in bytes")
    if backend == "gloo" and nprocs * threads_per_rank > (os.cpu_count() or 1):
        warnings.warn(f"{nprocs} ranks x {threads_per_rank} threads oversubscribe this machine's {os.cpu_count()} "
                      "cores: the link times will include scheduling delays", stacklevel=2)
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        args = (nprocs, _free_port(), threads_per_rank, list(sizes), warmup, repeats, backend, out, progress)
        try:
            mp.start_processes(_rank_main, args=args, nprocs=nprocs, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise RuntimeFailure(f"link profiling on {nprocs} {backend} ranks failed: {exc}") from exc
        with open(out) as fh:
            record = json.load(fh)
    return LinkProfile.from_record(record)


def _rank_main(rank: int, nprocs: int, port: int, threads: int, sizes: list[int], warmup: int, repeats: int,
               backend: str, out_path: str, show_progress: bool) -> None:
    """One rank of :func:`measure_links`; rank 0 writes the record to ``out_path``."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    extra: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=nprocs, timeout=timedelta(seconds=300), **extra)
    try:
        tasks = [(kind, size) for kind in COLLECTIVES for size in sizes]
        seconds = _time_tasks(tasks, rank, nprocs, device, warmup, repeats, show_progress and rank == 0)
        samples: dict[str, list[tuple[int, float]]] = {kind: [] for kind in COLLECTIVES}
        for (kind, size), t in zip(tasks, seconds):
            samples[kind].append((size, t / 2 if kind == "p2p" else t))  # p2p: a round trip is two messages
        fwd, bwd = _dispatch_overhead(device, nprocs)
        overlap = _overlap(device)
        context = _in_context(device, rank)
        if rank == 0:
            record = LinkProfile(backend=backend, nprocs=nprocs, threads_per_rank=threads, samples=samples,
                                 dispatch_fwd_seconds=fwd, dispatch_bwd_seconds=bwd,
                                 overlap_fraction=overlap, context_seconds=context).to_record()
            with open(out_path, "w") as fh:
                json.dump(record, fh)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


OVERLAP_BYTES = 4 * 2 ** 20
OVERLAP_TRIALS = 9


def _overlap(device: torch.device) -> float:
    """Fraction of an asynchronous all-reduce of OVERLAP_BYTES that a block of matmuls issued meanwhile
    hides: ``o = (T_c + T_a - T_both) / min(T_c, T_a)`` clipped to [0, 1], with ``T_a`` the all-reduce
    alone, ``T_c`` the compute alone (sized to take about ``T_a``), ``T_both`` the two together; each
    the mean over OVERLAP_TRIALS of the max over ranks. NCCL on GPUs overlaps (its kernels use their own
    SMs); gloo's threads compete with the compute for the CPU cores."""
    import torch.distributed as dist
    buf = torch.randn(OVERLAP_BYTES // _FLOAT_BYTES, device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)

    def comm_alone() -> None:
        dist.all_reduce(buf, async_op=True).wait()

    t_a = _mean_max(comm_alone, device)
    per = _mean_max(lambda: [a @ b for _ in range(10)], device) / 10
    n = max(1, round(t_a / max(per, 1e-9)))

    def compute() -> None:
        for _ in range(n):
            a @ b

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_c, t_both = _mean_max(compute, device), _mean_max(both, device)
    hidden = (t_c + t_a - t_both) / max(min(t_c, t_a), 1e-9)
    return float(min(1.0, max(0.0, hidden)))


def _mean_max(fn: Callable[[], object], device: torch.device) -> float:
    """Mean over OVERLAP_TRIALS barrier-started calls of ``fn`` of the slowest rank's seconds."""
    import torch.distributed as dist
    fn()
    times = []
    for _ in range(OVERLAP_TRIALS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(_max_over_ranks(times, device))


CONTEXT_COMPUTE_SECONDS = 0.02
CONTEXT_CALLS = 20
CONTEXT_BYTES = (64 * 2 ** 10, 2 * 2 ** 20)


def _in_context(device: torch.device, rank: int) -> dict[str, float]:
    """Extra seconds a collective costs when it follows a block of compute (as in a training step, where
    the backend's threads have gone to sleep and the ranks arrive apart) rather than another collective:
    ``mean(T(compute; op)) - mean(T(compute)) - mean(T(op; op))`` over CONTEXT_CALLS calls without
    barriers, the slowest rank's, averaged over CONTEXT_BYTES; for the all-reduce and for p2p
    (rank 0 sends to rank 1, both after their compute)."""
    import torch.distributed as dist
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    per = _mean_max(lambda: [a @ b for _ in range(10)], device) / 10
    n = max(1, round(CONTEXT_COMPUTE_SECONDS / max(per, 1e-9)))

    def compute() -> None:
        for _ in range(n):
            a @ b

    def loop(fn: Callable[[], object]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CONTEXT_CALLS):
            fn()
        _sync(device)
        return _max_over_ranks([(time.perf_counter() - start) / CONTEXT_CALLS], device)[0]

    out = {}
    for kind in ("all_reduce", "p2p"):
        extra = []
        for nbytes in CONTEXT_BYTES:
            buf = torch.randn(nbytes // _FLOAT_BYTES, device=device)
            if kind == "all_reduce":
                def op() -> None:
                    dist.all_reduce(buf)
            else:
                def op() -> None:
                    if rank == 0:
                        dist.send(buf, 1)
                    elif rank == 1:
                        dist.recv(buf, 0)
            op()
            extra.append(loop(lambda: (compute(), op())) - loop(compute) - loop(op))
        out[kind] = max(0.0, statistics.fmean(extra))
    return out


class _Buffers:
    """Two float32 buffers of the largest size; every op works on views of them (one allocation)."""

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        self.send = torch.ones(max_bytes // _FLOAT_BYTES, device=device)
        self.recv = torch.empty(max_bytes // _FLOAT_BYTES, device=device)

    def views(self, nbytes: int, send_div: int = 1, recv_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        numel = nbytes // _FLOAT_BYTES
        return self.send[:numel // send_div], self.recv[:numel // recv_div]


def _make_op(kind: str, nbytes: int, rank: int, nprocs: int, buffers: _Buffers) -> Callable[[], object]:
    """One call of ``kind`` on ``nbytes`` per-rank bytes (p2p: one round trip between ranks 0 and 1)."""
    import torch.distributed as dist
    if kind == "all_reduce":
        buf, _ = buffers.views(nbytes)
        return lambda: dist.all_reduce(buf)
    if kind == "all_gather":
        inp, out = buffers.views(nbytes, send_div=nprocs)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if kind == "reduce_scatter":
        inp, out = buffers.views(nbytes, recv_div=nprocs)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if kind == "all_to_all":
        inp, out = buffers.views(nbytes)
        return lambda: dist.all_to_all_single(out, inp)
    if kind == "p2p":
        buf, _ = buffers.views(nbytes)
        if rank == 0:
            return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
        if rank == 1:
            return lambda: (dist.recv(buf, 0), dist.send(buf, 0))
        return lambda: None
    raise ConfigError(f"unknown collective {kind!r}; known: {list(COLLECTIVES)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(op: Callable[[], object], calls: int, device: torch.device) -> list[float]:
    """Seconds of each of ``calls`` back-to-back calls of ``op``."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    import torch.distributed as dist
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _time_tasks(tasks: list[tuple[str, int]], rank: int, nprocs: int, device: torch.device, warmup: int,
                repeats: int, show_progress: bool) -> list[float]:
    """Seconds per call of every (collective, bytes) task (module docstring: one repeat).

    Every repeat visits the tasks in a new order (the same on every rank), so a burst of load
    from other processes hits one repeat of many tasks rather than every repeat of one.
    """
    import random

    import torch.distributed as dist
    buffers = _Buffers(max(size for _, size in tasks), device)
    ops = [_make_op(kind, size, rank, nprocs, buffers) for kind, size in tasks]
    fastest = []  # the fastest warm-up call: a call the machine did not stall sets the block length
    for op in ops:
        fastest.append(min(_time_calls(op, max(1, warmup), device)))
    calls = [max(1, min(MAX_CALLS_PER_BLOCK, math.ceil(BLOCK_SECONDS / max(t, 1e-9))))
             for t in _max_over_ranks(fastest, device)]
    times: list[list[float]] = [[] for _ in tasks]
    steps = [(r, i) for r in range(repeats) for i in random.Random(r).sample(range(len(tasks)), len(tasks))]
    for _, i in progress_bar(steps, desc=f"links x{nprocs}", enabled=show_progress):
        dist.barrier()
        times[i].extend(_time_calls(ops[i], calls[i], device))
    flat = _max_over_ranks([t for per_task in times for t in per_task], device)
    out, pos = [], 0
    for per_task in times:
        out.append(statistics.fmean(flat[pos:pos + len(per_task)]))
        pos += len(per_task)
    return out


def _per_call(fns: Sequence[Callable[[], object]], device: torch.device, calls: int) -> list[float]:
    """For each of ``fns``, the median over :data:`DISPATCH_BLOCKS` blocks of ``calls`` calls of the seconds
    per call; the functions' blocks alternate, so a slow spell of the machine hits them alike."""
    for fn in fns:
        for _ in range(max(10, calls // 10)):
            fn()
    blocks: list[list[float]] = [[] for _ in fns]
    for _ in range(DISPATCH_BLOCKS):
        for fn, per in zip(fns, blocks):
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            per.append((time.perf_counter() - start) / calls)
    return [statistics.median(per) for per in blocks]


class _LayerMix(torch.nn.Module):
    """The op mix of a tensor-parallel transformer layer at a negligible size: a linear (its weight split
    by rows across the mesh), gelu, two views, two transposes, a multiply and a sum."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.weight = torch.nn.Parameter(torch.randn(rows, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.weight))
        h = h.view(-1, self.rows).view(2, 4, self.rows).transpose(1, 2).transpose(1, 2)
        return (h * h).sum()


def _dispatch_overhead(device: torch.device, nprocs: int) -> tuple[float, float]:
    """(forward, backward) extra seconds per op when autopar's runtime runs ops as DTensors, max over ranks.

    The exported :class:`_LayerMix` is run node by node through the runtime's own ``NodeRunner``,
    once on plain tensors (no mesh) and once on DTensors of a 1-D mesh of all ranks (input
    ``Replicate``, weight ``Shard(0)``), forward and forward + backward; per node,
    ``fwd = (t_DT - t_plain) / nodes`` and ``bwd = ([t_DT(fb) - t_plain(fb)] - [t_DT - t_plain]) / nodes``."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    from ..runtime.chunk import NodeRunner

    mesh = init_device_mesh(device.type, (nprocs,))
    rows = 8 * nprocs
    program = torch.export.export(_LayerMix(rows).to(device), (torch.randn(2, 4, 8, device=device),), strict=False)
    split = SimpleNamespace(node_map={n.name: n for n in program.graph.nodes}, program=program)
    calls = [n.name for n in program.graph.nodes if n.op == "call_function"]
    weight_name, input_name = [n.name for n in program.graph.nodes if n.op == "placeholder"]

    def variant(dtensor: bool) -> tuple[Callable[[], object], Callable[[], object]]:
        runner = NodeRunner(split, mesh if dtensor else None, {})
        x, w = torch.randn(2, 4, 8, device=device), torch.randn(rows, 8, device=device)
        if dtensor:
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            w = DTensor.from_local(w.chunk(nprocs)[0].contiguous(), mesh, [Shard(0)], run_check=False)
        w = w.detach().requires_grad_()

        def forward() -> torch.Tensor:
            env: dict[str, Any] = {weight_name: w, input_name: x}
            for name in calls:
                env[name] = runner.run(name, env)
            return env[calls[-1]]

        def fwd_bwd() -> None:
            w.grad = None
            forward().backward()

        return forward, fwd_bwd

    (plain_fwd, plain_fb), (dt_fwd, dt_fb) = variant(False), variant(True)
    p_fwd, d_fwd, p_fb, d_fb = _per_call([plain_fwd, dt_fwd, plain_fb, dt_fb], device, 50)
    fwd = (d_fwd - p_fwd) / len(calls)
    bwd = ((d_fb - p_fb) - (d_fwd - p_fwd)) / len(calls)
    fwd, bwd = _max_over_ranks([fwd, bwd], device)
    return max(0.0, fwd), max(0.0, bwd)
