"""Every architecture of transformers' registries: capture with repeated blocks copied equals capture
tracing every block (make bench: AUTOPAR_ALL_CASES=1; 20-40 minutes on 2 cores).

Each architecture is built on the meta device from its own config's defaults shrunk to the test
size with LAYERS layers a stack (autopar/models/shrink.py; a default with fewer keeps its own, dropout
off) and captured from a batch-2 example twice: as capture() does (capture/repeat.py) and with
``AUTOPAR_TRACE_EVERY_BLOCK=1``. The two OpGraphs must be equal field by field (test_repeat.py's
capture_both), or both captures refused with the same error. Eight layers: three periods of one block
and copies (a lead of up to four), or three of two (Gemma2's alternation) and a copy; a branch on the
last layer's index would show in the copies. Each test prints how the blocks were captured (run with
``-rA`` or ``-s`` to read the outcomes). An architecture that cannot be built here, or whose two
captures take over TIMEOUT_S, is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.errors import AutoparError  # noqa: E402
from suite import ALL_CASES  # noqa: E402
from test_repeat import capture_both, traced_every_block  # noqa: E402

LAYERS = 8
TIMEOUT_S = 600


def _architectures():
    if not ALL_CASES:
        return []
    pytest.importorskip("transformers")
    from autopar.models.shrink import architectures
    return architectures()


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _limit(seconds: int):
    def alarm(*_):
        raise _Timeout()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
@pytest.mark.parametrize("arch", _architectures(), ids=lambda a: a.name)
def test_copied_equals_every_block_traced(arch) -> None:
    import transformers
    from autopar.models.shrink import ShrinkError, build, example
    transformers.logging.set_verbosity_error()
    try:
        model = build(arch, "meta", dropout=0.0, layers=LAYERS)
        inputs = example(arch, model, 2, device="meta")
    except ShrinkError as exc:
        pytest.skip(f"not built: {str(exc).splitlines()[0][:200]}")
    try:
        with _limit(TIMEOUT_S):
            try:
                outcome, _ = capture_both(model, inputs)
            except AutoparError as refused:   # refused copied: refused whole, the same way
                with pytest.raises(type(refused)) as whole:
                    traced_every_block(lambda: _capture(model, inputs))
                assert str(whole.value) == str(refused), "refused differently with every block traced"
                print(f"{arch.name}: refused both ways: {str(refused).splitlines()[0][:200]}")
                return
    except _Timeout:
        pytest.skip(f"the two captures take over {TIMEOUT_S} s")
    how = ("copied: " + "; ".join(outcome.copied) if outcome.copied else
           f"fell back: {outcome.fallback}" if outcome.fallback else
           "nothing to copy: " + ("; ".join(outcome.skipped) or "no block container"))
    print(f"{arch.name}: {how}")


def _capture(model, inputs):
    from autopar.capture import capture
    return capture(model, inputs)
