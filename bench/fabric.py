"""A fabric of more than one tier: plans on Meta's 24K-GPU RoCE fabric (Llama 3 paper, section 3.3.1: pods of
3,072 GPUs under full bisection bandwidth, 1:7 between pods; presets.FABRICS["llama3-24k-roce"]) against the
same clusters with one non-blocking tier (cost_model/comm.py: a ring's edge out of a pod gets its nodes'
share of the tier above, an all-to-all's cross-pod share crosses at 1 / 7 of the NICs).

For Llama 3 405B on 16,384 H100 (as Meta trained it: 5 1/3 pods) and a DeepSeek-V3-shaped MoE on 8,192
(2 2/3 pods), and the MoE again on a hypothetical fabric of 32-GPU leaves under 1:4: the plan without the tier,
that plan priced on the tiered fabric, and the plan made on it; each group of the tiered plan with the pods
it spans and whether the tier above binds it.
Targets: pricing is monotone (the tier never makes a plan faster) and the search adapts (its plan on the
fabric is no slower than the untiered plan priced there).

Run: .venv/bin/python bench/fabric.py   (about a minute)
"""

from __future__ import annotations

import sys
import time

import torch

import autopar
from autopar.capture import capture
from autopar.cost_model.comm import Collective, collective_lines
from autopar.cost_model.mesh import mesh_groups
from autopar.hardware import Fabric
from autopar.models import build
from autopar.presets import FABRICS
from autopar.solver import price, solve

META = FABRICS["llama3-24k-roce"]
# not a published fabric: leaves of 4 nodes (32 GPUs) under 1:4, where the tier binds the search's groups
SMALL_PODS = Fabric(pod_nodes=4, oversubscription=4.0, source="hypothetical: 32-GPU leaves, 1:4 above them")
ROWS = (("llama3-405b", "2048x8xH100-SXM", 2048, META), ("deepseek-v3-shaped", "1024x8xH100-SXM", 1024, META),
        ("deepseek-v3-shaped", "1024x8xH100-SXM", 1024, SMALL_PODS))


def binds(kind: Collective, group, tiered, plain) -> bool:
    untiered = group.__class__(size=group.size, ranks_per_node=group.ranks_per_node,
                               groups_per_node=group.groups_per_node)
    return (min(b for _, b in collective_lines(kind, group, tiered))
            > min(b for _, b in collective_lines(kind, untiered, plain)) * (1 + 1e-9))


def main() -> int:
    ok = True
    for name, spec, batch, fabric in ROWS:
        model, inputs = build(name, batch_size=1, device="meta", dtype=torch.bfloat16)
        graph = capture(model, inputs, progress=False)
        plain, tiered = autopar.Cluster.from_spec(spec), autopar.Cluster.from_spec(spec, fabric=fabric)
        t = time.perf_counter()
        flat, _ = solve(graph, plain, batch)
        there = price(graph, tiered, flat.config, batch, precision=flat.precision)
        adapted, _ = solve(graph, tiered, batch)
        seconds = time.perf_counter() - t
        print(f"{name} on {tiered.describe()} [{seconds:.0f} s]")
        for label, plan in (("one tier", flat), ("priced on the pods", there), ("planned on the pods", adapted)):
            b = plan.breakdown
            print(f"  {label:<20} {plan.config.short():<74.74} {plan.step_time:8.2f} s  dp/ZeRO exposed "
                  f"{b.dp_comm:6.3f} s  ep {b.ep_comm:6.3f} s  p2p {b.p2p:6.3f} s")
        groups = mesh_groups(tiered, adapted.config)
        def note(axis, g):
            if g.pods == 1:
                return ""
            if axis == "pp":   # point to point between neighbouring stages: one flow per boundary
                return " (point to point)"
            kind = Collective.ALL_TO_ALL if axis == "ep" else Collective.ALL_REDUCE
            return " (the tier binds)" if binds(kind, g, tiered, plain) else " (the tier does not bind)"
        spans = ", ".join(f"{axis} {g.size} over {g.pods} pod{'s' * (g.pods > 1)}{note(axis, g)}"
                          for axis, g in groups.items() if g.size > 1)
        print(f"  groups of the plan on the pods: {spans}")
        monotone = there.step_time >= flat.step_time * (1 - 1e-9) and adapted.step_time >= flat.step_time * (1 - 1e-9)
        adapts = adapted.step_time <= there.step_time * (1 + 1e-9)
        print(f"  the tier never speeds a plan up: {monotone}; the search's plan on it no slower: {adapts}")
        ok &= monotone and adapts
    print(f"targets met: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
