r"""Link fits: the alpha-beta model of every collective from measured samples, and its Link.

The samples come from link_timing.py (:func:`~autopar.profiler.link_timing.measure_links`: what is
measured, how, and the noise of a small VM are described there).

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

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from ..conditions import REFRESH_ADVICE, ProfileConditions
from ..hardware import CollectiveFit, Link
from ..errors import ConfigError
from .host import check_threads

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""The collectives :func:`measure_links` times, named as in ``autopar.hardware.COLLECTIVE_NAMES``."""
MIN_SEGMENT = 3
"""Sizes each segment of a two-segment fit needs at least."""
PIECEWISE_GAIN = 2.0
"""A two-segment fit is kept when its trimmed loss is below the line's divided by this (two more
parameters must earn their keep: roughly an F-test at 5% for 10-20 sizes)."""
OUTLIER_REL_ERROR = 0.3
"""A sample this far (relative) from a fit is an outlier: it counts as if just this far when fits
are compared (the trimmed loss), so one stalled sample cannot pick the model."""


# --- The profile ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """Measured collective times of ``nprocs`` local ranks and the tensor-parallel dispatch overhead."""

    backend: str
    """"gloo" or "nccl"."""
    nprocs: int
    """Ranks that took part (the group size ``n`` of every collective but p2p)."""
    threads_per_rank: int
    """``torch.set_num_threads`` of every rank."""
    samples: Mapping[str, tuple[tuple[int, float], ...]]
    """Collective name -> ((per-rank bytes, seconds), ...) in increasing bytes. Stored read-only."""
    dispatch_fwd_seconds: float
    """Extra seconds per op of a forward run as lowered tensor-parallel layer code instead of plain code."""
    dispatch_bwd_seconds: float
    """Extra seconds per op of the backward of those ops."""
    overlap_fraction: float
    """Fraction of an asynchronous all-reduce's time that compute issued meanwhile hides (0..1)."""
    context_seconds: Mapping[str, float]
    """Extra seconds per call of a collective issued right after compute, over back-to-back calls
    ("all_reduce" for the ring collectives, "p2p"); stored read-only."""
    concurrency_slowdown: float = 1.0
    """How much longer a rank computes when every rank computes at once than alone (>= 1)."""
    dtensor_step_seconds: float = 0.0
    """Extra seconds per parameter tensor of an AdamW step on DTensor (FSDP2) parameters over plain ones."""
    conditions: ProfileConditions | None = None
    """What it was measured under (autopar/conditions.py); None for one not measured by measure_links.
    Its record must carry them: a record without (an older autopar's) is measured again."""

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
        for name in ("dispatch_fwd_seconds", "dispatch_bwd_seconds", "dtensor_step_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"LinkProfile.{name}={value!r} must be a finite number of seconds >= 0")
        value = self.concurrency_slowdown
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
            raise ConfigError(f"LinkProfile.concurrency_slowdown={value!r} must be a finite number >= 1")
        if self.conditions is not None and not isinstance(self.conditions, ProfileConditions):
            raise ConfigError(f"LinkProfile.conditions={self.conditions!r} must be ProfileConditions or None")

    def __hash__(self) -> int:
        return hash((self.backend, self.nprocs, self.threads_per_rank, tuple(sorted(self.samples.items())),
                     self.dispatch_fwd_seconds, self.dispatch_bwd_seconds, self.overlap_fraction,
                     tuple(sorted(self.context_seconds.items())), self.concurrency_slowdown, self.dtensor_step_seconds,
                     self.conditions))

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
                "context_seconds": dict(self.context_seconds), "concurrency_slowdown": self.concurrency_slowdown,
                "dtensor_step_seconds": self.dtensor_step_seconds,
                "conditions": None if self.conditions is None else self.conditions.to_dict()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "LinkProfile":
        """The profile :meth:`to_record` wrote; ConfigError when a field is missing or malformed (also when
        it records no measurement conditions: unknown conditions are measured again)."""
        needed = ("backend", "nprocs", "threads_per_rank", "collectives", "dispatch_fwd_seconds",
                  "dispatch_bwd_seconds", "overlap_fraction", "context_seconds", "concurrency_slowdown",
                  "dtensor_step_seconds", "conditions")
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
                   overlap_fraction=record["overlap_fraction"], context_seconds=record["context_seconds"],
                   concurrency_slowdown=record["concurrency_slowdown"],
                   dtensor_step_seconds=record["dtensor_step_seconds"],
                   conditions=ProfileConditions.from_dict(record["conditions"]))


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
        raise ConfigError(f"the {kind} fit has beta = 0 s/byte (time does not grow with size; its samples are a "
                          f"median {fit.median_rel_error:.0%} off it): measure it up to larger sizes so the "
                          "bandwidth can be fitted, or, when they reach megabytes, the small messages stalled: "
                          f"{REFRESH_ADVICE}")
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
