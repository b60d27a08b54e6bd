"""Plots of a Plan (matplotlib, drawn on an Agg canvas without pyplot).

- :func:`plot_timeline`: the pipeline schedule of one step as a Gantt chart;
- :func:`plot_memory`: bytes per pipeline device by kind against the device's memory;
- :func:`plot_partition`: which layers each pipeline device (and chunk) holds.

Each takes ``(plan, path=None)``, saves a PNG at ``path`` when given and returns the
matplotlib Figure. Matplotlib is needed only when a plot is drawn.
"""

from .memory import plot_memory
from .partition import plot_partition
from .timeline import plot_timeline

__all__ = ["plot_memory", "plot_partition", "plot_timeline"]
