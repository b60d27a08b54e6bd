"""Waiting on communication with a deadline, so that a dead or silent peer fails the run loudly.

Every asynchronous send, receive and collective the program starts itself is started through
:func:`start` and waited on with ``Work.wait(timeout)``; when the deadline passes (or the peer's
connection breaks, which gloo may report as the collective starts or as it is waited on) the rank
raises :class:`autopar.RuntimeFailure` naming itself, the collective and the peer rank(s),
instead of hanging. Collectives that run inside an op (tensor parallelism's, FSDP2's) use the process
group's own timeout (``init_process_group(timeout=...)``); :func:`at_step` turns what they raise
(and anything else a step raises) into a RuntimeFailure naming the rank and the step.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .errors import AutoparError, RuntimeFailure

_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("autopar_step", default=None)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _who_am_i() -> str:
    step = _STEP.get()
    return f"rank {_rank()}" + ("" if step is None else f", step {step}")


@contextlib.contextmanager
def at_step(step: int, what: str) -> Iterator[None]:
    """Inside, RuntimeFailures name the step; any other exception (a collective inside an op or
    FSDP2 breaking because a peer died, or this rank's own error) becomes a RuntimeFailure naming
    this rank, the step and ``what`` was running, with the original as its ``__cause__``.
    AutoparErrors (a bad batch, a non-finite loss) pass through unchanged."""
    token = _STEP.set(step)
    try:
        yield
    except AutoparError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as RuntimeFailure, the original chained
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise RuntimeFailure(f"{_who_am_i()}: {what} failed with {type(exc).__name__}: {first}; if it names a "
                             "peer or a closed connection, that rank died or stopped answering: check its log for "
                             "the first error") from exc
    finally:
        _STEP.reset(token)


class Failed:
    """A collective that raised as it started (gloo reports a connection a dead peer closed at once): its
    ``wait`` raises that error, so :func:`wait_or_fail` names the collective and its peers as it does for
    one that fails while it runs."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True


def start(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``collective(*args, **kwargs)`` (started with ``async_op=True``): its work, or a :class:`Failed` one
    when starting it raised."""
    try:
        return collective(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - raised again by the wait, naming the collective and its peers
        return Failed(exc)


def wait_or_fail(work: Any, timeout: float, what: str, group: Any = None, peers: Sequence[int] | None = None) -> None:
    """Wait for ``work``; raise RuntimeFailure naming the collective and its peers on timeout or error."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses or DistBackendError
        raise RuntimeFailure(_message(what, timeout, group, peers, exc)) from exc
    if ok is False:
        raise RuntimeFailure(_message(what, timeout, group, peers, None))


def peer_wait(timeout: float) -> Callable[[Any, str, int | Sequence[int]], None]:
    """A PipelineRunner's ``wait(work, what, peer)``: :func:`wait_or_fail` naming the peer (or the peers of a
    collective)."""
    def wait(work: Any, what: str, peer: int | Sequence[int]) -> None:
        wait_or_fail(work, timeout, what, peers=[peer] if isinstance(peer, int) else list(peer))
    return wait


def _message(what: str, timeout: float, group: Any, peers: Sequence[int] | None, exc: Exception | None) -> str:
    me = _rank()
    if peers is None and dist.is_initialized():
        try:
            ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
            peers = [r for r in ranks if r != me]
        except (RuntimeError, ValueError):
            peers = None
    who = f"rank {peers[0]}" if peers and len(peers) == 1 else f"ranks {list(peers)}" if peers else "a peer"
    cause = f" ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})" if exc is not None else ""
    return (f"{_who_am_i()}: {what} with {who} failed or did not complete within {timeout:g} s{cause}: {who} died "
            "or stopped answering; check that rank's log for the first error (raise "
            "autopar.parallelize(..., timeout=) if it is only slow)")


def non_finite_norm(norm: torch.Tensor, rank: int, step: int) -> RuntimeFailure | None:
    """The failure for a gradients' total norm that is not finite (optim.clip_grad_norm_'s, the same on every
    rank: every rank stops alike), or None."""
    value = float(norm)
    if math.isfinite(value):
        return None
    return RuntimeFailure(
        f"rank {rank}, step {step}: the gradients' total norm is {value} while every micro-batch's loss is finite (a "
        "gradient overflowed in backward): the optimizer step was skipped, so the parameters are unchanged; lower the "
        "learning rate, or find the op that overflows in this precision")


def non_finite_loss(losses: torch.Tensor, rank: int, step: int, micro_batches: int, micro_batch_size: int,
                    per_replica: int) -> RuntimeFailure | None:
    """The failure for the first non-finite entry of ``losses`` (``dp * micro_batches`` values,
    replica-major), naming its micro-batch, replica and samples of the global batch; None if all
    are finite."""
    values = losses.tolist()   # a few numbers: read in Python, not by four tensor ops each step
    bad = [k for k, v in enumerate(values) if not math.isfinite(v)]
    if not bad:
        return None
    replica, i = divmod(bad[0], micro_batches)
    first = replica * per_replica + i * micro_batch_size
    more = f" (and {len(bad) - 1} more micro-batch(es))" if len(bad) > 1 else ""
    return RuntimeFailure(
        f"rank {rank}, step {step}: the loss of micro-batch {i} of data-parallel replica {replica} (samples "
        f"{first}..{first + micro_batch_size - 1} of the global batch) is {values[bad[0]]}{more}: the "
        "optimizer step was skipped, so the parameters are unchanged; check those samples, lower the learning "
        "rate, or clip gradients")
