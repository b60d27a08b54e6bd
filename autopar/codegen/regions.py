"""MoE regions run as one expert-parallel call (ep > 1, or cp > 1 on an MoE model): which the call can stand
in for. A region it cannot (an inner value read outside it, an unknown activation, a capacity under
context parallelism, experts ep does not divide, a region over two layers) is refused at compile time
with what to change, before any rank builds anything."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..capture.opgraph import MoERegion
from ..errors import ConfigError
from ..runtime.expert_parallel import ACTIVATIONS


def check_regions(regions: Sequence[MoERegion], nodes: Mapping[str, Any], layer_of: Mapping[str, int],
                  param_of: Mapping[str, str], ep: int, cp: int, ignored: frozenset[str] = frozenset()) -> None:
    """Refuse regions the expert-parallel call cannot stand in for (ConfigError naming the region);
    ``ignored``: nodes never run (metadata asserts), whatever they read."""
    for r in regions:
        where = f"MoE region {r.module} (output {r.output})"
        if getattr(r, "capacity", None) is not None and cp > 1:
            raise ConfigError(f"{where} drops assignments beyond a capacity of {r.capacity} slots per expert, which "
                              "depends on every token of the sequence, while context parallelism gives a rank part of "
                              "it: build the model without a capacity (capacity_factor=None) or re-plan with cp=1")
        if r.activation not in ACTIVATIONS:
            raise ConfigError(f"{where} uses activation {r.activation!r}, which expert parallelism does not know "
                              f"(it knows {sorted(ACTIVATIONS)}): re-plan with ep=1, cp=1")
        if r.num_experts % ep:
            raise ConfigError(f"{where} has {r.num_experts} experts, which ep={ep} does not divide: re-plan with an "
                              "ep dividing the expert count")
        inside = set(r.nodes)
        for name in r.nodes:
            if name == r.output or name not in nodes:
                continue
            outside = [u.name for u in nodes[name].users if u.name not in inside and u.name not in ignored]
            if outside:
                raise ConfigError(f"{where}: node {outside[0]} outside the region reads its inner value {name}, "
                                  "so the region cannot run as one expert-parallel call: re-plan with ep=1, cp=1")
        layers = {layer_of.get(name) for name in r.nodes if name in layer_of}
        if len(layers) > 1:
            raise ConfigError(f"{where} spans layers {sorted(layers)}: re-plan with ep=1, cp=1")
        for p in (r.gate_up, r.down):
            readers = [n.name for n in nodes.values() if n.op == "call_function" and n.name not in inside
                       and any(param_of.get(a.name) == p for a in n.all_input_nodes)]
            if readers:
                raise ConfigError(f"{where}: node {readers[0]} outside the region reads expert weight {p}: re-plan "
                                  "with ep=1, cp=1")
