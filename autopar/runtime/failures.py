"""Waiting on communication with a deadline, so that a dead or silent peer fails the run loudly.

Every asynchronous send, receive and collective the program starts itself is waited on with
``Work.wait(timeout)``; when the deadline passes (or the peer's connection breaks) the rank
raises :class:`autopar.RuntimeFailure` naming itself, the collective and the peer rank(s),
instead of hanging. Collectives that DTensor and FSDP2 run inside an op use the process
group's own timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch.distributed as dist

from ..errors import RuntimeFailure


def wait_or_fail(work: Any, timeout: float, what: str, group: Any = None, peers: Sequence[int] | None = None) -> None:
    """Wait for ``work``; raise RuntimeFailure naming the collective and its peers on timeout or error."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses or DistBackendError
        raise RuntimeFailure(_message(what, timeout, group, peers, exc)) from exc
    if ok is False:
        raise RuntimeFailure(_message(what, timeout, group, peers, None))


def _message(what: str, timeout: float, group: Any, peers: Sequence[int] | None, exc: Exception | None) -> str:
    me = dist.get_rank() if dist.is_initialized() else 0
    if peers is None and group is not None and dist.is_initialized():
        try:
            peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        except (RuntimeError, ValueError):
            peers = None
    who = f"rank {peers[0]}" if peers and len(peers) == 1 else f"ranks {list(peers)}" if peers else "a peer"
    cause = f" ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})" if exc is not None else ""
    return (f"rank {me}: {what} with {who} failed or did not complete within {timeout:g} s{cause}: {who} died or stopped "
            "answering; check that rank's log for the first error (raise autopar.parallelize(..., timeout=) if "
            "it is only slow)")
