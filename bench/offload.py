"""Offloading: the CPU optimizer step the cost model prices, measured here, and plans that fit only so.

1. **The CPU step** (cost_model/offload.py: ``28 bytes per parameter / the host's streaming bandwidth``), on
   this machine's CPU: a 64 M-parameter fp32 AdamW step (torch.optim.AdamW, fused, as the model prices it;
   the default tensor-by-tensor loop beside it) against 28 bytes per parameter over the bandwidth of STREAM's
   Triad measured alike (its bytes counted as they move: with write-allocate, 16 an element); and the same
   step as ``offload="optimizer"`` runs it (runtime/optim.MasterOptimizer over host copies, the weights copied
   back: on a CPU, 8 more bytes a parameter at the same rate). Target: both within 25% of the model.
2. **Plans that fit only offloaded**: Llama 3 8B on one H100 and Llama 3 70B on 8 H100 (sequence 8192, one
   sequence per micro-batch, 16 sequences a step): ZeRO-3's states (16 bytes per parameter) outgrow the GPU
   (128 GB and 140 GB per device), so without offload nothing fits; the search, free to offload the optimizer
   or ZeRO-3's states whole, finds a plan that keeps states in host memory (DGX H100: 250 GB per GPU).
   Target: both fit, offloaded, and planning without offload raises InfeasiblePlanError.

Run: .venv/bin/python bench/offload.py   (about 1 minute)
"""

from __future__ import annotations

import math
import sys
import time

import torch

import autopar
from autopar.capture import capture
from autopar.cost_model.offload import CPU_ADAM_BYTES
from autopar.errors import InfeasiblePlanError
from autopar.models import build
from autopar.runtime.optim import MasterOptimizer
from autopar.solver import solve

TARGET = 0.25
PARAMS = 64 * 2**20


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def cpu_step(rounds: int = 10) -> bool:
    torch.manual_seed(0)
    a, b, c = torch.randn(PARAMS), torch.randn(PARAMS), torch.empty(PARAMS)
    # STREAM's Triad (c = b + s a: two reads and a write per element), the streaming rate HOST_STREAM_EFFICIENCY
    # takes of a server's channels. Its bytes as they move here: torch writes ``c`` with ordinary stores, so each
    # line of ``c`` is read before it is written (write-allocate), 16 bytes an element where STREAM counts 12
    # (servers' published Triad figures are mostly taken with non-temporal stores, which move what they
    # count); the AdamW step updates its arrays in place, and its 28 bytes are what it moves
    def triad():
        torch.add(b, a, alpha=2.0, out=c)
    steps = {}
    for name, kwargs in (("fused", dict(fused=True)), ("tensor by tensor (default)", dict(foreach=False)),
                         ("fused, offload=\"optimizer\"", dict(fused=True, host=True))):
        params = [torch.nn.Parameter(torch.randn(PARAMS // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        host = kwargs.pop("host", False)
        make = lambda ps, kwargs=kwargs: torch.optim.AdamW(ps, lr=1e-3, **kwargs)   # noqa: E731
        opt = MasterOptimizer(params, make) if host else make(params)
        opt.step()   # the states made
        steps[name] = (opt.step, host, kwargs.get("fused", False))
    # in rounds, each step beside a Triad of the same moment (this shared machine's bandwidth drifts): the best
    # of each over the rounds
    triad()
    best = {name: math.inf for name in ("triad", *steps)}
    for _ in range(rounds):
        best["triad"] = min(best["triad"], _timed(triad))
        for name, (step, _, _) in steps.items():
            best[name] = min(best[name], _timed(step))
    stream = 4 * PARAMS * 4 / best["triad"]
    predicted = CPU_ADAM_BYTES / stream
    print(f"Triad {stream / 1e9:.1f} GB/s ({torch.get_num_threads()} threads): the model's AdamW step "
          f"{predicted * 1e9:.2f} ns/parameter")
    ok = True
    for name, (_, host, fused) in steps.items():
        measured = best[name] / PARAMS
        # offloaded on a CPU, the weights' copy back: read and written at the streaming rate (offload.py)
        model = predicted + (2 * 4 / stream if host else 0.0)
        error = model / measured - 1
        print(f"  AdamW {name:<27} {measured * 1e9:.2f} ns/parameter, model {error * 100:+.0f}%")
        if fused:
            ok &= abs(error) <= TARGET
    print(f"fused steps within {TARGET * 100:.0f}% of the model: {ok}")
    return ok


def plans() -> bool:
    ok = True
    print(f"\n{'model on cluster':<26} {'plan':<68} {'step s':>7} {'opt s':>6} {'dp s':>6} {'GB/GPU':>6}  host")
    for name, spec in (("llama3-8b", "1x1xH100-SXM"), ("llama3-70b", "1x8xH100-SXM")):
        model, inputs = build(name, batch_size=1)
        graph = capture(model, inputs, progress=False)
        cluster = autopar.Cluster.from_spec(spec)
        t = time.perf_counter()
        plan, _ = solve(graph, cluster, 16)
        seconds = time.perf_counter() - t
        try:
            solve(graph, cluster, 16, fixed={"offload": "none"})
            refused = False
        except InfeasiblePlanError:
            refused = True
        good = plan.fits and plan.config.offload != "none" and refused
        ok &= good
        host = next((n for n in plan.notes if n.startswith("offload:")), "")
        print(f"{name + ' on ' + spec:<26} {plan.config.short():<68.68} {plan.step_time:>7.2f} "
              f"{plan.breakdown.optimizer:>6.2f} {plan.breakdown.dp_comm:>6.2f} {plan.peak_memory / 1e9:>6.1f}  "
              f"{host[9:45]}  ({seconds:.0f} s){'' if refused else '  FITS WITHOUT OFFLOAD'}")
    print(f"each fits only offloaded, and the search offloads: {ok}")
    return ok


def main() -> int:
    first, second = cpu_step(), plans()
    print(f"\ntargets met: CPU step {first}, plans {second}")
    return 0 if first and second else 1


if __name__ == "__main__":
    sys.exit(main())
