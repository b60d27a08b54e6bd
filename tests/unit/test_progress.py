"""Progress bars: shown on a terminal once the work takes over DELAY_SECONDS, never in pipes or logs."""

from __future__ import annotations

import contextlib
import io
import sys

import autopar.progress as progress
import autopar.solver.bounded_queue as bounded_queue
import autopar.solver.search as search_module
from autopar import Cluster
from autopar.capture import capture
from autopar.models.llama import LlamaConfig, build_llama
from autopar.solver import solve

SMALL_LLAMA = LlamaConfig(vocab_size=512, hidden=256, heads=4, kv_heads=2, layers=3, ffn_hidden=512, seq_len=128)


class Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run(monkeypatch, tty: bool, enabled: bool) -> tuple[list[int], str]:
    stream = Terminal(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)     # show at once instead of after a second
    items = list(progress.progress_bar(range(5), "autopar: testing", enabled=enabled))
    return items, stream.getvalue()


def test_terminal_shows_a_bar(monkeypatch):
    items, shown = _run(monkeypatch, tty=True, enabled=True)
    assert items == list(range(5)) and "autopar: testing" in shown and "/5 [" in shown


def test_pipe_or_disabled_stays_quiet(monkeypatch):
    for tty, enabled in ((False, True), (True, False)):
        items, shown = _run(monkeypatch, tty=tty, enabled=enabled)
        assert items == list(range(5)) and shown == ""


class Recorded:
    """A bar that records what it was told, for deterministic checks of counts and units."""

    def __init__(self, desc: str, total, unit: str) -> None:
        self.desc, self.total, self.unit, self.n, self.seen = desc, total, unit, 0, []

    def update(self, k: int) -> None:
        self.n += k
        self.seen.append(self.n)


def _recording(monkeypatch, *modules) -> list[Recorded]:
    """The bars the ``counter`` of each of ``modules`` opens, in the order they open."""
    bars: list[Recorded] = []

    @contextlib.contextmanager
    def counter(desc, total=None, unit="it", enabled=True):
        bar = Recorded(desc, total, unit)
        if enabled:
            bars.append(bar)
        yield bar
    for module in modules:
        monkeypatch.setattr(module, "counter", counter)
    return bars


def test_capture_counts_the_repeated_layers_it_traces(monkeypatch):
    """A bar of the blocks traced, in layers; the graph is the same with and without it."""
    bars = _recording(monkeypatch, progress)
    model, inputs = build_llama(SMALL_LLAMA, batch_size=1, device="meta")
    quiet = capture(model, inputs)
    assert bars == []
    shown = capture(model, inputs, progress=True)
    assert [(b.desc, b.total, b.unit, b.seen) for b in bars] == [("autopar: capturing", 3, "layers", [1, 2, 3])]
    assert shown.nodes == quiet.nodes and shown.structure.fingerprint == quiet.structure.fingerprint


def test_search_bars_count_candidates_bounded_and_settled(monkeypatch):
    """Bounding counts every candidate; the search's bar counts the queued candidates whose fate is
    known, most of them pruned by the first plans' step times, so that its remaining time is the
    search's (a bar of evaluations over every queued candidate showed hours for seconds)."""
    bars = _recording(monkeypatch, bounded_queue, search_module)   # bounding's bar, then the search's
    model, inputs = build_llama(SMALL_LLAMA, batch_size=1, device="meta")
    graph = capture(model, inputs)
    _, stats = solve(graph, Cluster.from_spec("4x8xA100-80GB"), 256, progress=True)
    bounding, searching = bars
    assert (bounding.desc, bounding.unit, bounding.total, bounding.n) == \
        ("autopar: bounding", "candidates", None, stats.candidates)
    assert (searching.desc, searching.unit, searching.n) == ("autopar: searching", "candidates", searching.total)
    assert stats.evaluated <= searching.total <= stats.candidates - stats.dominated
    assert searching.seen == sorted(searching.seen)
    first = searching.seen[0]       # after the first evaluation
    assert stats.evaluated > 1 and first > searching.total // 2

