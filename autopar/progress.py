"""Progress bars for work that takes over a second (search, profiling), on terminals only."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

DELAY_SECONDS = 1.0
"""A bar appears only once the work has taken this long."""


def progress_bar(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr that appears after :data:`DELAY_SECONDS`; none when
    ``enabled`` is False or stderr is not a terminal (logs and pipes stay clean)."""
    from tqdm.auto import tqdm
    yield from tqdm(items, desc=desc, total=total, delay=DELAY_SECONDS, file=sys.stderr,
                    disable=True if not enabled else None, leave=False, dynamic_ncols=True)
