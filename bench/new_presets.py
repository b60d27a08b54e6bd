"""The 2026 presets (B200, GB200 NVL72, H20, H800, MI300X, MI325X, MI355X): what calibrates them, what
validates them, and the plans they give.

1. **Collectives.** Published all-reduce bus bandwidths (nccl-tests / rccl-tests, large messages), split
   before fitting: the one-domain rows set the presets' link constants (presets.py: NVLink 5's ring share,
   NVLS, xGMI's share) and must come back within 2%; the multi-node rows validate, untouched by any fit.
   GB200 beyond one rack runs NCCL's NVLS-tree (in-rack NVLS, a tree across racks), which the cost model
   does not price: those rows are reported, with no target, as what the model misses.
2. **GEMMs.** Each family's ``matmul_efficiency`` from its public large-GEMM figure (presets.py says the
   rule): printed so a reader sees the kernel figure each rests on. No training run on these parts is
   used, so none validates them.
3. **Plans.** GPT-3 175B, Llama 3 70B and a DeepSeek-V3-shaped MoE (models/registry.py) planned on about
   1,000 GPUs of every new preset (bf16, fused kernels): each must fit, at an MFU below the device's
   ``matmul_efficiency`` (no step runs its GEMMs better than the GEMMs run alone).
4. **NVLink domains larger than a node.** A 64-expert MoE that needs ep = 64 to fit (device memory capped
   at 16 GB, no pipeline, ZeRO-1) on 64 GB200 as one NVL72 rack running 64 GPUs ("1x64xGB200") and as
   eight 8-GPU domains ("8x8xGB200"): the rack's plan keeps the expert-parallel group inside its domain
   and must be faster.

Run: .venv/bin/python bench/new_presets.py [--quick]   (--quick: plans on three presets; about 2 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

import autopar
from autopar.capture import capture
from autopar.config import Precision
from autopar.cost_model.comm import Collective, GroupPlacement, bus_bandwidth, collective_time
from autopar.cost_model.mesh import mesh_groups
from autopar.models import build
from autopar.models.moe import Mixtral, MixtralConfig
from autopar.presets import DEVICE_PRESETS
from autopar.solver import solve

GiB = 2 ** 30
# name, cluster, (ranks, per node, groups per node), bytes, published busbw GB/s, NVLS off, source
CALIBRATION = [
    ("8 x B200 ring (NVLS off)", "1x8xB200", (8, 8, 1), 8 * GiB, 682.2, True,
     "stas00/ml-engineering network/README.md, NCCL 2.27.7"),
    ("8 x B200 NVLS", "1x8xB200", (8, 8, 1), 8 * GiB, 838.0, False, "same"),
    ("GB200 NVL72 rack, 72 GPUs", "1x72xGB200", (72, 72, 1), 8e9, 834.57, False,
     "coreweave/nccl-tests README, NCCL 2.26.2"),
    ("8 x MI300X (xGMI)", "1x8xMI300X", (8, 8, 1), 16e9, 318.98, False,
     "ROCm blog: RCCL bandwidth and xGMI on MI300X, RCCL 2.22.3"),
]
VALIDATION = [
    ("4 x 8 B200 (8 x 400G EFA)", "4x8xB200", (32, 8, 1), 16 * GiB, 381.80, False,
     "stas00/ml-engineering network/README.md"),
]
NOT_MODELLED = [   # NCCL's NVLS-tree across GB200 racks
    ("2 GB200 racks, 144 GPUs", "2x72xGB200", (144, 72, 1), 16e9, 810.41, False, "coreweave/nccl-tests README"),
    ("20 GB200 racks, 1,440 GPUs", "20x72xGB200", (1440, 72, 1), 16e9, 405.74, False, "same"),
]

# public large bf16 GEMM figures (TFLOP/s) behind each family's matmul_efficiency (presets.py)
GEMM = {"H100-SXM": (794.5, "MAMF table (stas00/ml-engineering): the reference of STACK_SHARE"),
        "B200": (1745.0, "MAMF table"), "GB200": (1822.0, "MAMF table"), "MI300X": (668.4, "MAMF table"),
        "MI325X": (784.9, "MAMF table"), "MI355X": (1565.0, "MAMF table"),
        "H20": (141.86, "zzc0721/torch-performance-test-data database.md")}

NEW = ("B200", "GB200", "H20", "H800", "MI300X", "MI325X", "MI355X")
CLUSTERS = {"B200": "128x8xB200", "GB200": "16x64xGB200", "H20": "128x8xH20", "H800": "128x8xH800",
            "MI300X": "128x8xMI300X", "MI325X": "128x8xMI325X", "MI355X": "128x8xMI355X"}
QUICK = ("B200", "GB200", "MI300X")
MODELS = (("gpt3-175b", 1536), ("llama3-70b", 512), ("deepseek-v3-shaped", 1024))   # global batch (sequences)


def collectives() -> bool:
    print(f"{'all-reduce bus bandwidth':<30} {'split':<12} {'published':>9} {'predicted':>9} {'error':>7}  source")
    ok = True
    for split, rows in (("calibration", CALIBRATION), ("validation", VALIDATION), ("not modelled", NOT_MODELLED)):
        errors = []
        for name, spec, (n, r, g), size, published, ring, source in rows:
            cluster = autopar.Cluster.from_spec(spec)
            if ring:
                cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node,
                                                                                      sharp_bandwidth=0.0))
            group = GroupPlacement(size=n, ranks_per_node=r, groups_per_node=g)
            seconds = collective_time(Collective.ALL_REDUCE, size, group, cluster)
            predicted = bus_bandwidth(Collective.ALL_REDUCE, size, seconds, n) / 1e9
            errors.append(predicted / published - 1)
            print(f"{name:<30} {split:<12} {published:>9.1f} {predicted:>9.1f} {errors[-1] * 100:>+6.1f}%  {source}")
        if split == "calibration":
            ok &= max(abs(e) for e in errors) <= 0.02
    print(f"calibration rows within 2%: {ok}")
    return ok


def gemms() -> None:
    print(f"\n{'device':<10} {'bf16 peak':>10} {'GEMM TFLOP/s':>12} {'share':>6} {'matmul_efficiency':>17}  source")
    for name, (tflops, source) in GEMM.items():
        d = DEVICE_PRESETS[name]
        print(f"{name:<10} {d.peak('bf16') / 1e12:>10.1f} {tflops:>12.1f} {tflops * 1e12 / d.peak('bf16'):>6.3f} "
              f"{d.matmul_efficiency:>17.3f}  {source}")


def plans(presets: tuple[str, ...]) -> bool:
    print(f"\n{'model':<19} {'cluster':<14} {'plan':<66} {'step s':>7} {'MFU':>5} {'peak GB':>7} {'plan s':>6}")
    ok = True
    fused = Precision(kernels="fused")
    for name, batch in MODELS:
        model, inputs = build(name, batch_size=1)
        graph = capture(model, inputs, progress=False)
        for device in presets:
            t = time.perf_counter()
            plan, _ = solve(graph, autopar.Cluster.from_spec(CLUSTERS[device]), batch, precision=fused)
            good = plan.fits and 0 < plan.mfu < plan.cluster.device.matmul_efficiency
            ok &= good
            print(f"{name:<19} {CLUSTERS[device]:<14} {plan.config.short():<66.66} {plan.step_time:>7.2f} "
                  f"{plan.mfu * 100:>4.0f}% {plan.peak_memory / 1e9:>7.1f} {time.perf_counter() - t:>6.1f}"
                  f"{'' if good else '  DOES NOT FIT, OR MFU ABOVE THE GEMM EFFICIENCY'}")
    print(f"every plan fits, at an MFU below its device's matmul_efficiency: {ok}")
    return ok


def domain() -> bool:
    cfg = MixtralConfig(layers=12, hidden=4096, heads=32, kv_heads=8, ffn_hidden=2048, vocab_size=32000, seq_len=4096,
                        num_experts=64, top_k=8, capacity_factor=1.0)
    with torch.device("meta"):
        model = Mixtral(cfg)
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    graph = capture(model, {"input_ids": tokens, "labels": tokens}, progress=False)
    print(f"\n{'64-expert MoE on 64 GB200':<28} {'plan':<52} {'ep group':<18} {'ep comm s':>9} {'step s':>7}")
    steps = {}
    for spec in ("1x64xGB200", "8x8xGB200"):
        cluster = autopar.Cluster.from_spec(spec, device_memory=16e9)
        plan, _ = solve(graph, cluster, 512, fixed={"zero": 1, "pp": 1})
        ep = mesh_groups(cluster, plan.config)["ep"]
        steps[spec] = (plan, ep)
        print(f"{spec:<28} {plan.config.short():<52.52} {f'{ep.size} on {ep.nodes} node(s)':<18} "
              f"{plan.breakdown.ep_comm:>9.2f} {plan.step_time:>7.2f}")
    (rack, ep_rack), (nodes, _) = steps["1x64xGB200"], steps["8x8xGB200"]
    ok = ep_rack.nodes == 1 and rack.config.tp * rack.config.ep > 8 and rack.step_time < nodes.step_time
    print(f"the rack keeps tp x ep = {rack.config.tp * rack.config.ep} in its NVLink domain and is "
          f"{nodes.step_time / rack.step_time:.2f}x faster: {ok}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="plans on three presets only")
    args = parser.parse_args()
    t0 = time.perf_counter()
    comm_ok = collectives()
    gemms()
    plans_ok = plans(QUICK if args.quick else NEW)
    domain_ok = domain()
    print(f"\n{time.perf_counter() - t0:.0f} s; targets met: collectives {comm_ok}, plans {plans_ok}, "
          f"NVLink domain {domain_ok}")
    return 0 if comm_ok and plans_ok and domain_ok else 1


if __name__ == "__main__":
    sys.exit(main())
