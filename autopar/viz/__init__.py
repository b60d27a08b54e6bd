"""Plots of a Plan (matplotlib, drawn on an Agg canvas without pyplot).

- :func:`plot_timeline`: the pipeline schedule of one step as a Gantt chart;
- :func:`plot_memory`: bytes per pipeline device by kind against the device's memory;
- :func:`plot_partition`: which layers each pipeline device (and chunk) holds;
- :func:`plot_sweep`: a :class:`autopar.Sweep`'s throughput, MFU and time to train against GPUs.

Each takes ``(plan, path=None)`` (``plot_sweep``: ``(sweep, path=None)``), saves a PNG at ``path`` when given and returns the
matplotlib Figure. Matplotlib is needed only when a plot is drawn.
"""

from .memory import plot_memory
from .partition import plot_partition
from .sweep import plot_sweep
from .timeline import plot_timeline

__all__ = ["plot_memory", "plot_partition", "plot_sweep", "plot_timeline"]
