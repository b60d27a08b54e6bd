"""ZeRO-2/3 units (ModelStructure.shard_units): each repeated block alone, each run of the other layers
together, layers without parameters in none; the cost model counts a stage's collectives by them, in
the stage DP's tables and in the full estimate alike."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar import Cluster
from autopar.capture.structure import ModelStructure
from autopar.config import ParallelConfig
from autopar.cost_model.estimator import Estimator


def _structure(bodies: list[int]) -> ModelStructure:
    return ModelStructure(layers=tuple((f"l{i}", b) for i, b in enumerate(bodies)),
                          bodies=tuple(() for _ in range(max(bodies) + 1)))


def test_blocks_alone_and_runs_of_the_rest_together():
    # embedding, three blocks, final norm, a layer without parameters, head
    s = _structure([0, 1, 1, 1, 2, 3, 4])
    holds = lambda i: i != 5  # noqa: E731
    assert s.repeated == (False, True, True, True, False, False, False)
    assert s.shard_units(range(7), holds) == ((0,), (1,), (2,), (3,), (4, 6))
    assert s.shard_units([3, 4, 5, 6], holds) == ((3,), (4, 6))
    assert s.shard_units([4, 5], holds) == ((4,),)
    # with no repeated body everything is one run
    assert _structure([0, 1, 2]).shard_units(range(3), lambda i: True) == ((0, 1, 2),)


def test_cost_model_tables_count_the_units_of_every_run():
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=3, batch_size=1)
    graph = autopar.capture.capture(model, inputs)
    cfg = ParallelConfig(dp=2, zero=3, micro_batch_size=1)
    est = Estimator(graph, Cluster.from_spec("1x2xcpu"), autopar.Precision(compute="fp32", grads="fp32"))
    count, largest, kept = est.unit_tables(cfg)
    n = len(graph.layers)
    units = est.shard_units(range(n), cfg)
    assert len(units) < n   # the final norm and the head share a unit
    for i in range(n):
        for j in range(i, n):
            run = est.shard_units(range(i, j + 1), cfg)
            assert count[i, j] == len(run)
            assert largest[i, j] == max((sum(est._layer_params(k, cfg) for k in u) for u in run), default=0)
            # ZeRO-3 keeps the unit that ends the model gathered from forward to backward, no other
            ends = j == n - 1 and bool(run)
            assert kept[i, j] == (sum(est._layer_params(k, cfg) for k in run[-1]) if ends else 0)
    assert np.all(count[np.tril_indices(n, -1)] == 0)
    assert kept[0, n - 1] == sum(est._layer_params(k, cfg) for k in units[-1]) > 0


def test_zero3_gathers_the_kept_unit_once_per_micro_batch():
    """The backward re-gather leaves out the kept unit: the same run priced with nothing kept costs
    exactly one more all-gather of that unit's weights (with one collective more) per micro-batch."""
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=3, batch_size=1)
    graph = autopar.capture.capture(model, inputs)
    cfg = ParallelConfig(dp=2, zero=3, micro_batch_size=1)
    est = Estimator(graph, Cluster.from_spec("1x2xcpu"), autopar.Precision(compute="fp32", grads="fp32"))
    groups = est.placements(cfg)
    n = len(graph.layers)
    count, _, kept = est.unit_tables(cfg)
    params = sum(est._layer_params(k, cfg) for k in range(n))
    args = (cfg, 4, groups, params, 0.0, 0.0, 0.0, 0.0, 0.0, count[0, n - 1], 0.0)
    with_kept, without = est.dp_time(*args, kept[0, n - 1]), est.dp_time(*args, 0.0)
    from autopar.cost_model.comm import Collective
    w_b = est.precision.weight_bytes
    regather = lambda nbytes, calls: float(est._ct(Collective.ALL_GATHER, nbytes, groups["dp"], calls))  # noqa: E731
    gap = 4 * (regather(params * w_b, count[0, n - 1]) - regather((params - kept[0, n - 1]) * w_b, count[0, n - 1] - 1))
    assert without - with_kept == pytest.approx(gap, rel=1e-9) and gap > 0
