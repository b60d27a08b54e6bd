"""What each device holds of the model's parameters, per layer and per run of layers, after tensor and expert
parallelism, and the ZeRO-2/3 (FSDP2) units a run of layers is wrapped in.

A parameter of ``n`` elements is held as ``n / t`` on each rank where the tensor-parallel layout splits it, and
``n / e`` where it is an expert weight; a layer holds its own parameters and the tied ones it reads
(``Layer.shared_params``). For a run of layers ``[i, j]`` (one stage's chunk) the tables here give, as ``n x n``
arrays: its ZeRO-2/3 units (ModelStructure.shard_units, as the runtime wraps them), the parameters of its largest,
those ZeRO-3 keeps gathered after forward, and what FSDP2 gathers in fp8. Per layer, the lead tensor is the first
parameter its forward reads, whose gradient a backward over a run starting there completes last
(StepTail.dp_time). The Estimator holds these as part of itself (:class:`ParamTables` is its base); they are
counts, cached per (tp, ep), that step_tail.py and memory.py price.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from ..config import ParallelConfig
from ..plan.structure import ShardUnits
from .low_precision import gathered_weights


class ParamTables:
    """Parameter counts and ZeRO unit tables of one graph under a tensor-parallel layout: the Estimator's base.

    The class that mixes it in provides ``graph`` (an OpGraph), ``layers`` (its LayerCostModel, for the layout's
    split parameters), ``experts`` (the expert parameters), ``precision`` and the caches ``_numel``, ``_units`` and
    ``_device_params`` (dicts)."""

    def _held(self, idx: tuple[int, ...], cfg: ParallelConfig) -> tuple[dict, int, int]:
        """(names, local parameters, local expert parameters) of a device holding layers ``idx``: each
        parameter once, tied ones included (a pipeline stage may hold a copy). Cached: the search
        asks for the same runs of layers many times."""
        key = (idx, cfg.tp, cfg.ep)
        if key not in self._device_params:
            names = dict.fromkeys(n for i in idx for n in self._layer_param_names(i) if n in self.graph.params)
            self._device_params[key] = (names, self._local_params(names, cfg),
                                        self._local_params([n for n in names if n in self.experts], cfg))
        return self._device_params[key]

    def own_params(self, cfg: ParallelConfig) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, the parameters it owns (shared ones counted at their owner only, so a run's
        sum is at most what a device holding it holds) and the expert ones among them, after tensor
        and expert parallelism (cached per tp and ep)."""
        key = ("own", cfg.tp, cfg.ep)
        if key not in self._numel:
            layers = self.graph.layers
            self._numel[key] = (np.array([self._local_params(l.params, cfg) for l in layers], dtype=float),
                                np.array([self._local_params([n for n in l.params if n in self.experts], cfg)
                                          for l in layers], dtype=float))
        return self._numel[key]

    def lead_params(self, cfg: ParallelConfig) -> np.ndarray:
        """Per layer, the parameters (one device's, after tp and ep) of the first parameter tensor its forward
        reads, tied ones included: of a run of layers starting there, the gradient the backward completes last
        (a language model's first stage: the token embedding). Bucketed reductions never split a tensor, so the
        step's last bucket holds at least it (StepTail.dp_time). Cached per tp and ep."""
        key = ("lead", cfg.tp, cfg.ep)
        if key not in self._numel:
            out = []
            for layer in self.graph.layers:
                first = next((p for node in self.graph.layer_nodes(layer) for p in node.params
                              if p in self.graph.params), None)
                out.append(0.0 if first is None else float(self.local_numel(first, cfg.tp, cfg.ep)))
            self._numel[key] = np.array(out)
        return self._numel[key]

    def shard_units(self, layers: Sequence[int], cfg: ParallelConfig) -> ShardUnits:
        """The ZeRO-2/3 (FSDP2) units a chunk of ``layers`` is wrapped in (ModelStructure.shard_units, as
        the runtime wraps them): each unit one all-gather and one reduce-scatter."""
        return self.graph.structure.shard_units(layers, lambda i: self._layer_params(i, cfg) > 0)

    def _unit_params(self, layers: Sequence[int], cfg: ParallelConfig) -> int:
        """Parameters of the largest ZeRO-3 unit of a chunk (gathered whole, with the next prefetched)."""
        return max((sum(self._layer_params(i, cfg) for i in unit) for unit in self.shard_units(layers, cfg).units),
                   default=0)

    def unit_tables(self, cfg: ParallelConfig) -> tuple[np.ndarray, ...]:
        """For every run ``[i, j]`` of layers (one stage's chunk): how many ZeRO-2/3 units it makes, the
        parameters of its largest, and the parameters and number of the units ZeRO-3 keeps gathered
        after forward (``ShardUnits.kept``), as ``n x n`` arrays. ModelStructure.shard_units decides each
        layer's unit from the layers before it alone, so the units of ``[i, j]`` are those of ``[i, n)``
        cut at ``j``: one call per start."""
        key = (cfg.tp, cfg.ep)
        if key not in self._units:
            n = len(self.graph.layers)
            params = np.array([self._layer_params(i, cfg) for i in range(n)], dtype=float)
            count, largest, n_kept = (np.zeros((n, n)) for _ in range(3))
            for i in range(n):
                starts, partial = np.zeros(n), np.zeros(n)   # partial: a unit's parameters up to each layer
                units = self.shard_units(range(i, n), cfg)
                for unit in units.units:
                    starts[unit[0]] = 1
                    partial[list(unit)] = np.cumsum(params[list(unit)])
                count[i, i:] = np.cumsum(starts[i:])
                largest[i, i:] = np.maximum.accumulate(partial[i:])
                if units.root:
                    n_kept[i, units.root[0]:] = 1
                n_kept[i, n - 1] += sum(1 for u in units.kept if u != units.root)
            self._units[key] = (count, largest, self.kept_tables(cfg, params), n_kept)
        return self._units[key]

    def kept_tables(self, cfg: ParallelConfig, values: np.ndarray) -> np.ndarray:
        """For every run ``[i, j]`` of layers, the sum of ``values`` (one per layer) over the units ZeRO-3 keeps
        gathered after forward: the root's layers so far, from its first layer on (it is kept in every chunk),
        and, for a chunk ending the model, its last unit (ShardUnits.kept; :meth:`unit_tables`)."""
        n = len(values)
        kept = np.zeros((n, n))
        for i in range(n):
            units = self.shard_units(range(i, n), cfg)
            if units.root:
                root = np.zeros(n)
                root[list(units.root)] = np.cumsum(values[list(units.root)])
                kept[i, i:] = np.maximum.accumulate(root[i:])
            kept[i, n - 1] += sum(values[list(u)].sum() for u in units.kept if u != units.root)
        return kept

    def fp8_layer_tables(self, cfg: ParallelConfig) -> tuple[np.ndarray, ...] | None:
        """For every run ``[i, j]`` of layers, the (elements, tensors) its layers own that FSDP2 gathers in fp8 and
        those of the units ZeRO-3 keeps gathered (dp_exposed's ``fp8``), or None when the plan gathers none."""
        if not self.precision.gathers_fp8(cfg):
            return None
        key = ("fp8", cfg.tp, cfg.ep)
        if key not in self._units:
            owned = [self._fp8_gathered(layer.params) for layer in self.graph.layers]
            elements, tensors = (np.array([x[k] for x in owned], dtype=float) for k in (0, 1))
            self._units[key] = (_runs(elements), _runs(tensors), self.kept_tables(cfg, elements),
                                self.kept_tables(cfg, tensors))
        return self._units[key]

    def _layer_param_names(self, i: int) -> tuple[str, ...]:
        layer = self.graph.layers[i]
        return layer.params + layer.shared_params

    def _local_params(self, names, cfg: ParallelConfig) -> int:
        """Parameters of ``names`` one device holds after tensor parallelism splits them."""
        return sum(self.local_numel(n, cfg.tp, cfg.ep) for n in names if n in self.graph.params)

    def local_numel(self, name: str, tp: int, ep: int = 1) -> int:
        """Elements of parameter ``name`` one device holds: divided by tp when the layout splits it,
        by ep when it is an expert weight."""
        key = (name, tp, ep)
        if key not in self._numel:
            numel = self.graph.params[name].numel
            numel = numel // tp if name in self.layers.layout(tp).split_params else numel
            self._numel[key] = numel // ep if name in self.experts else numel
        return self._numel[key]

    def _layer_params(self, i: int, cfg: ParallelConfig) -> int:
        key = (i, cfg.tp, cfg.ep)
        if key not in self._numel:
            self._numel[key] = self._local_params(self._layer_param_names(i), cfg)
        return self._numel[key]

    @functools.cached_property
    def fp8_weights(self) -> frozenset[str]:
        """The weights an fp8 plan that gathers in fp8 gathers so (low_precision.gathered_weights)."""
        return gathered_weights(self.graph)

    def _fp8_gathered(self, names) -> tuple[int, int]:
        """(elements, tensors) of parameters ``names`` gathered in fp8 (tensor parallelism is 1 there)."""
        mine = [n for n in names if n in self.fp8_weights]
        return sum(self.graph.params[n].numel for n in mine), len(mine)

def _runs(values: np.ndarray) -> np.ndarray:
    """``out[i, j]``: the sum of ``values[i..j]`` (0 where ``j < i``)."""
    pre = np.concatenate([[0.0], np.cumsum(values)])
    out = pre[None, 1:] - pre[:-1, None]
    return np.where(np.triu(np.ones_like(out, dtype=bool)), out, 0.0)
