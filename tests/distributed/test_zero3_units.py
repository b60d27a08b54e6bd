"""ZeRO-3's FSDP2 units in the runtime are the ones the cost model prices (ModelStructure.shard_units):
each decoder layer alone, resharded after forward; the embedding, final norm and head (runs of far
fewer than MIN_UNIT_PARAMS parameters) in the chunk's root unit, kept gathered from forward to backward
(tests/unit/cost_model/test_shard_units.py checks the cost model's side)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import worlds  # noqa: E402


def fsdp_units(rank: int, size: int) -> tuple[list, list]:
    """On each rank: (the layers of each FSDP2 parameter group the program made with whether it reshards
    after forward, shard_units' units)."""
    import torch
    import autopar
    import autopar.models.hf as hf
    torch.manual_seed(0)
    model, inputs = hf.build_hf_llama(layers=3, batch_size=1, dropout=0.0)
    plan = autopar.plan(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, global_batch_size=4, verbose=False,
                        fixed=dict(dp=2, tp=1, pp=1, zero=3, micro_batch_size=2, recompute="none", schedule="1f1b",
                                   virtual_stages=1, sequence_parallel=False))
    program = autopar.parallelize(model, plan)
    groups: dict[int, list[int]] = {}
    reshards: dict[int, bool] = {}
    for chunk in program.chunks.values():
        root = chunk._get_fsdp_state()._fsdp_param_group   # the layers no unit of their own holds
        for layer in chunk.layers:
            if not any(True for _ in layer.parameters(recurse=False)):
                continue
            state = layer._get_fsdp_state() if hasattr(layer, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None) or root
            groups.setdefault(id(group), []).append(layer.spec.index)
            reshards[id(group)] = group.post_forward_mesh_info is not None
    layers = [layer.spec.index for chunk in program.chunks.values() for layer in chunk.layers]
    holds = {layer.spec.index: any(True for _ in layer.parameters(recurse=False))
             for chunk in program.chunks.values() for layer in chunk.layers}
    made = sorted((units, reshards[g]) for g, units in groups.items())
    return made, [list(u) for u in program.graph.structure.shard_units(layers, holds.get).units]


def test_runtime_wraps_the_units_the_cost_model_prices():
    for made, priced in worlds.world(2).run("test_zero3_units:fsdp_units"):
        assert [units for units, _ in made] == sorted(priced)
        assert priced[0] == [0, 4, 5] and priced[1:] == [[1], [2], [3]]   # [embedding, final norm, head]
        assert [resharded for _, resharded in made] == [False, True, True, True]
