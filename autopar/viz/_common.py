"""Shared plumbing of the plots: a pyplot-free Agg figure, saving, and unit formatting.

Figures are made with ``matplotlib.figure.Figure`` and an explicit ``FigureCanvasAgg`` so that
plotting never touches pyplot's global state or the user's chosen backend (``matplotlib.use``
is process-wide). Matplotlib is imported lazily: ``import autopar.viz`` and the geometry
helpers work without it, and the plot functions raise ConfigError saying how to install it.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

DPI = 120
"""Resolution of saved PNGs (dots per inch)."""

def byte_unit(nbytes: float) -> tuple[str, float]:
    """The unit to show ``nbytes`` in, and the bytes per unit: decimal (10^9 bytes a GB, as device
    datasheets count), GB down to bytes."""
    for size, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if nbytes >= size:
            return unit, size
    return "bytes", 1.0


def new_figure(width: float, height: float) -> Any:
    """An empty ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches on an Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(f"autopar's plots need matplotlib, which cannot be imported ({exc}): "
                          "pip install matplotlib") from None
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def finish(fig: Any, path: str | os.PathLike | None) -> Any:
    """Save ``fig`` as a PNG at ``path`` when given, and return it. (There is nothing to close: a
    figure made without pyplot is not registered anywhere and is freed with its last reference.)"""
    if path is not None:
        fig.savefig(os.fspath(path), dpi=DPI, bbox_inches="tight", format="png")
    return fig


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit to show a span of ``seconds`` in, and the factor seconds are multiplied by."""
    if seconds >= 1.0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def format_time(seconds: float) -> str:
    """``29.9 s`` / ``39.8 ms`` / ``12 µs``: three significant digits."""
    unit, scale = time_unit(seconds)
    return f"{seconds * scale:.3g} {unit}"


def format_count(n: float) -> str:
    """``2.80 B`` / ``21.3 M`` / ``512 K`` / ``96``: a parameter count, three significant digits."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.3g} {suffix}"
    return f"{n:.0f}"


def chunk_order(plan: Any) -> list[tuple[int, int]]:
    """(device, local chunk) of every model chunk in model order: chunk ``g`` lives on device
    ``cfg.chunk_device(g)`` as that device's ``cfg.device_chunks(d).index(g)``-th chunk (looped for the
    interleaved placement, a V for ZB-V; ``v = 1`` is the plain one-chunk-per-device pipeline)."""
    cfg = plan.config
    out = []
    for g in range(cfg.pp * cfg.virtual_stages):
        d = cfg.chunk_device(g)
        j = cfg.device_chunks(d).index(g)
        if j < len(plan.stages[d].chunks):
            out.append((d, j))
    return out


def mix(color: Any, other: Any, amount: float) -> tuple[float, float, float]:
    """``color`` moved ``amount`` (0..1) of the way towards ``other`` (RGB)."""
    from matplotlib.colors import to_rgb
    a, b = to_rgb(color), to_rgb(other)
    return tuple(x + (y - x) * amount for x, y in zip(a, b))  # type: ignore[return-value]
