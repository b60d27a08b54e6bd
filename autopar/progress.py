"""Progress bars for work that takes over a second (capture, search, profiling), on terminals only.

Each bar counts a truthful unit of its phase (layers captured, candidates bounded, candidates settled),
so that its rate and, where the total is known, its remaining time are what the phase will take."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence, TypeVar

if TYPE_CHECKING:
    from torch import nn

T = TypeVar("T")

DELAY_SECONDS = 1.0
"""A bar appears only once the work has taken this long."""


def progress_bar(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr that appears after :data:`DELAY_SECONDS`; none when
    ``enabled`` is False or stderr is not a terminal (logs and pipes stay clean)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with counter(desc, total=total, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update(1)


@contextlib.contextmanager
def counter(desc: str, total: int | None = None, unit: str = "it", enabled: bool = True):
    """A tqdm bar (on stderr, after :data:`DELAY_SECONDS`, on a terminal, unless ``enabled`` is False)
    that the caller moves with ``update(n)`` or by setting ``n``; with ``total`` None it shows the count
    and the rate only (no remaining time it cannot know)."""
    from tqdm.auto import tqdm
    bar = tqdm(desc=desc, total=total, unit=unit, delay=DELAY_SECONDS, file=sys.stderr,
               disable=True if not enabled else None, leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def module_calls(modules: Sequence["nn.Module"], desc: str, unit: str, enabled: bool = True):
    """While open, a bar of ``len(modules)`` that each call of one of ``modules`` moves by one (a
    forward pre-hook that reads nothing of the call, so a trace of the model is unchanged)."""
    if not modules or not enabled:
        yield None
        return
    with counter(desc, total=len(modules), unit=unit, enabled=enabled) as bar:
        hooks = [m.register_forward_pre_hook(lambda *_: bar.update(1)) for m in modules]
        try:
            yield bar
        finally:
            for hook in hooks:
                hook.remove()
