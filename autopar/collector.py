"""Python's cyclic garbage collector paused around planning's two heavy phases.

Capture (torch.export, then the OpGraph of thousands of fx nodes) and the search each make hundreds of
thousands of objects. The collector's oldest generation sweeps the whole heap, the captured model's and
torch's objects included, each time enough of them have survived; during those phases it would sweep it
several times (capture of Hugging Face's GPT-2 at GPT-3 175B's shape: 1.1 s with it, 0.9 s without; Llama
at 405B's shape 1.9-2.0 s against 1.5 s; the search of the GPT-2: 1.2-1.4 s of a 13-15 s search, before
the search's bounds made it shorter). The search makes no reference cycles (gc.collect() after it finds
none); torch.export does (about 110,000 objects for the Llama, at unchanged peak memory): those are freed
by the first collection after the phase, once, instead of the heap being swept during it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, and as it was before after it (nested blocks and a caller
    that had it off already keep it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
