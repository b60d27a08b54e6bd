"""Progress bars: shown on a terminal once the work takes over DELAY_SECONDS, never in pipes or logs."""

from __future__ import annotations

import io
import sys

import autopar.progress as progress


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
