"""ZeRO-2/3 units (ModelStructure.shard_units): each repeated block alone, each run of the other layers
together, the runs of fewer than MIN_UNIT_PARAMS parameters in one (the chunk's root), layers without
parameters in none; the cost model counts a stage's collectives by them, in the stage DP's tables and
in the full estimate alike."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar import Cluster
from autopar.plan.structure import MIN_UNIT_PARAMS, Anchor, ModelStructure
from autopar.config import ParallelConfig
from autopar.cost_model.estimator import Estimator


def _structure(bodies: list[int], numel: dict[int, int] | None = None) -> ModelStructure:
    """Layers with these bodies; body ``b`` reads one parameter of ``numel[b]`` elements (default: big)."""
    numel = numel or {}
    return ModelStructure(layers=tuple((f"l{i}", b) for i, b in enumerate(bodies)),
                          bodies=tuple((Anchor("linear", (("*.w", (numel.get(b, MIN_UNIT_PARAMS),)),)),)
                                       for b in range(max(bodies) + 1)))


def test_blocks_alone_and_runs_of_the_rest_together():
    # embedding, three blocks, final norm, a layer without parameters, head: all large
    s = _structure([0, 1, 1, 1, 2, 3, 4])
    holds = lambda i: i != 5  # noqa: E731
    assert s.repeated == (False, True, True, True, False, False, False)
    units = s.shard_units(range(7), holds)
    assert units.units == ((0,), (1,), (2,), (3,), (4, 6)) and units.root is None
    assert units.kept == ((4, 6),)                        # the unit that ends the model
    assert s.shard_units([3, 4, 5, 6], holds).units == ((3,), (4, 6))
    assert s.shard_units([4, 5], holds).units == ((4,),) and s.shard_units([4, 5], holds).kept == ()
    # with no repeated body everything is one run
    assert _structure([0, 1, 2]).shard_units(range(3), lambda i: True).units == ((0, 1, 2),)


def test_small_runs_share_the_chunks_root_unit():
    # a small embedding, blocks, a small final norm and a large head (an untied 128k vocabulary)
    s = _structure([0, 1, 1, 2, 3], numel={0: 10, 2: 10, 3: 600_000_000})
    units = s.shard_units(range(5), lambda i: True)
    assert units.units == ((0,), (1,), (2,), (3, 4)) and units.root == (0,)
    assert units.kept == ((0,), (3, 4))                   # the root, and the unit ending the model
    # norm and head small too: one root unit for the embedding, the norm and the head, kept
    s = _structure([0, 1, 1, 2, 3], numel={0: 10, 2: 10, 3: 10})
    units = s.shard_units(range(5), lambda i: True)
    assert units.units == ((0, 3, 4), (1,), (2,)) and units.kept == ((0, 3, 4),)
    # a chunk's cut does not change a layer's unit: the units of a prefix are the whole's, cut
    assert s.shard_units(range(4), lambda i: True).units == ((0, 3), (1,), (2,))
    assert s.shard_units([2, 3, 4], lambda i: True).units == ((2,), (3, 4))


def test_cost_model_tables_count_the_units_of_every_run():
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=3, batch_size=1)
    graph = autopar.capture.capture(model, inputs)
    cfg = ParallelConfig(dp=2, zero=3, micro_batch_size=1)
    est = Estimator(graph, Cluster.from_spec("1x2xcpu"), autopar.Precision(compute="fp32", grads="fp32"))
    count, largest, kept, n_kept = est.unit_tables(cfg)
    n = len(graph.layers)
    units = est.shard_units(range(n), cfg)
    assert units.root is not None and len(units.units) < n   # embedding, final norm and head share a unit
    for i in range(n):
        for j in range(i, n):
            run = est.shard_units(range(i, j + 1), cfg)
            assert count[i, j] == len(run.units)
            assert largest[i, j] == max((sum(est._layer_params(k, cfg) for k in u) for u in run.units), default=0)
            # ZeRO-3 keeps the root gathered from forward to backward, and the unit ending the model
            assert kept[i, j] == sum(est._layer_params(k, cfg) for u in run.kept for k in u)
            assert n_kept[i, j] == len(run.kept)
    assert np.all(count[np.tril_indices(n, -1)] == 0)
    assert kept[0, n - 1] == sum(est._layer_params(k, cfg) for k in units.root) > 0


def test_zero3_gathers_the_kept_unit_once_per_micro_batch():
    """The backward re-gather leaves out the kept unit: the same run priced with nothing kept costs
    exactly one more all-gather of that unit's weights (with one collective more) per micro-batch, and its
    copies in and out (FSDP2's, around the gather: 2 ranks, so the copy-in moves half of what the copy-out does)."""
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=3, batch_size=1)
    graph = autopar.capture.capture(model, inputs)
    cfg = ParallelConfig(dp=2, zero=3, micro_batch_size=1)
    est = Estimator(graph, Cluster.from_spec("1x2xcpu"), autopar.Precision(compute="fp32", grads="fp32"))
    groups = est.placements(cfg)
    n = len(graph.layers)
    count, _, kept, n_kept = est.unit_tables(cfg)
    params = sum(est._layer_params(k, cfg) for k in range(n))
    args = (cfg, 4, groups, params, 0.0, 0.0, 0.0, 0.0, 0.0, count[0, n - 1], 0.0)
    assert n_kept[0, n - 1] == 1
    with_kept, without = est.tail.dp_time(*args, kept[0, n - 1], 1), est.tail.dp_time(*args, 0.0, 0)
    from autopar.cost_model.comm import Collective
    w_b = est.precision.weight_bytes
    regather = lambda nbytes, calls: float(  # noqa: E731
        est.tail.collective(Collective.ALL_GATHER, nbytes, groups["dp"], calls))
    copies = lambda elements, calls: float(  # noqa: E731
        est.tail.passes(2 * elements * w_b / 2, calls) + est.tail.passes(2 * elements * w_b, calls))
    units, left = count[0, n - 1], params - kept[0, n - 1]
    gap = 4 * (regather(params * w_b, units) + copies(params, units)
               - regather(left * w_b, units - 1) - copies(left, units - 1))
    assert without - with_kept == pytest.approx(gap, rel=1e-9) and gap > 0
