"""LayerWork: what a candidate's bounds (bounds.py, even_split.py) need from its layers for one micro-batch,
per layout, tensor, sequence, context and expert parallelism and micro-batch size: each layer's work and
activation bytes in every recompute mode, its recomputation, forward and weight-gradient seconds, and the
Lagrangian knapsacks over them (even_split.Knapsack; the maths is bounds.py's module docstring). Made once per
such key by SearchBounds._layer_work and cached on the search.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .even_split import Knapsack


@dataclass(frozen=True)
class LayerWork:
    """What a candidate's bounds need from its layers (one micro-batch), by layout, tensor,
    sequence, context and expert parallelism and micro-batch size."""

    total: float        # W: every layer in its cheapest mode
    params: float       # P: parameters per device after tensor and expert parallelism
    experts: float      # of which expert weights
    work: np.ndarray    # (distinct layers, modes) seconds
    acts: np.ndarray    # (distinct layers, modes) activation bytes
    rerun: np.ndarray   # (distinct layers, modes) recomputation seconds, which a split backward pays twice
    counts: np.ndarray  # layers of each distinct row
    least_acts: float        # sum_l min_r a_l^r: one pass of every layer in its leanest mode
    costliest: np.ndarray    # (layers,) each layer's work in its cheapest mode, costliest first
    layer_rows: np.ndarray   # (layers,) each layer's row of ``work`` / ``acts`` / ``rerun``
    kind_forward: np.ndarray    # (kinds,) forward seconds with its collectives of each kind of layer (every mode's)
    kind_wgrad: np.ndarray      # (kinds,) weight-gradient seconds (the same in every mode)
    kind_plain: np.ndarray      # (kinds,) work without its recomputation (the same in every mode)
    kinds: np.ndarray           # (layers,) each layer's kind (Estimator.kinds)

    # in layer order, made when a bound needs them (the even split's): most candidates' bounds take the totals
    @functools.cached_property
    def layer_work(self) -> np.ndarray:
        """(layers, modes) seconds."""
        return self.work[self.layer_rows]

    @functools.cached_property
    def layer_acts(self) -> np.ndarray:
        """(layers, modes) activation bytes."""
        return self.acts[self.layer_rows]

    @functools.cached_property
    def layer_rerun(self) -> np.ndarray:
        """(layers, modes) recomputation seconds."""
        return self.rerun[self.layer_rows]

    @functools.cached_property
    def layer_forward(self) -> np.ndarray:
        return self.kind_forward[self.kinds]

    @functools.cached_property
    def layer_wgrad(self) -> np.ndarray:
        return self.kind_wgrad[self.kinds]

    @functools.cached_property
    def forward_total(self) -> float:
        return float(self.layer_forward.sum())

    @functools.cached_property
    def wgrad_total(self) -> float:
        return float(self.layer_wgrad.sum())

    @functools.cached_property
    def plain_total(self) -> float:
        return float(self.kind_plain[self.kinds].sum())

    @functools.cached_property
    def knapsack(self) -> Knapsack:
        """The Lagrangian bound of its distinct layers (module docstring), their counts the one group."""
        return Knapsack(self.work, self.acts, self.counts[:, None])

    @functools.cached_property
    def split_knapsack(self) -> Knapsack:
        """:attr:`knapsack` under a split backward (the zero-bubble schedules), whose two passes each rerun a
        recomputing layer's forward (cost_model/estimator.reruns)."""
        return Knapsack(self.work + self.rerun, self.acts, self.counts[:, None])
