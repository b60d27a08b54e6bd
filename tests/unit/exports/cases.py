"""The plans the export tests run on: the two stored published recipes (make_goldens.py) and variants of
them that the goldens do not cover, each a plan with another configuration and its layers cut into
that configuration's chunks."""

from __future__ import annotations

import dataclasses

import autopar
from make_goldens import RECIPES, plan_path

PLANS = sorted(RECIPES)


def load_plans() -> dict[str, autopar.Plan]:
    return {name: autopar.load_plan(plan_path(name)) for name in PLANS}


def with_partition(plan: autopar.Plan, chunks: list[list[str]], **changes) -> autopar.Plan:
    """``plan`` with other config fields and its layers cut into ``chunks`` (model order: chunk c on
    device cfg.chunk_device(c)), for the cases no stored plan has."""
    cfg = dataclasses.replace(plan.config, **changes)
    pp, v = cfg.pp, cfg.virtual_stages
    assert len(chunks) == pp * v
    stages = []
    for d in range(pp):
        own = tuple(tuple(chunks[c]) for c in cfg.device_chunks(d))
        stages.append(dataclasses.replace(plan.stages[min(d, len(plan.stages) - 1)], index=d, chunks=own,
                                          layers=tuple(n for c in own for n in c)))
    return dataclasses.replace(plan, config=cfg, stages=tuple(stages))


def even_chunks(plan: autopar.Plan, n: int, shift: int = 0) -> list[list[str]]:
    """The plan's layers in ``n`` model chunks: the blocks evenly (``shift`` blocks moved from the first
    chunk to the last), the layers before them in the first, after them in the last."""
    layers = autopar.exports.common.layers_of(plan)
    per = len(layers.blocks) // n
    sizes = [per - shift] + [per] * (n - 2) + [per + shift] if n > 1 else [per]
    chunks, i = [], 0
    for size in sizes:
        chunks.append(list(layers.blocks[i:i + size]))
        i += size
    chunks[0][:0] = layers.pre
    chunks[-1].extend(layers.post)
    return chunks


VARIANTS = [   # (stored plan, config changes, precision changes, blocks moved from the first chunk to the last)
    ("llama3-70b_8x8xH100", dict(dp=4, tp=4, pp=4, zero=1, recompute="selective"), {}, 0),
    ("llama3-70b_8x8xH100", dict(dp=2, tp=8, pp=4, schedule="interleaved", virtual_stages=2, zero=0,
                                 recompute="full", recompute_layers=5), dict(kernels="compiled"), 0),
    ("llama3-70b_8x8xH100", dict(dp=8, tp=1, pp=8, schedule="gpipe", zero=2, recompute="none",
                                 stage_recompute=("full",) * 4 + ("selective", "none", "none", "none"),
                                 sequence_parallel=False), dict(grads="bf16", optimizer="sgd"), 2),
    ("llama3-70b_8x8xH100", dict(dp=64, tp=1, zero=0, sequence_parallel=False, micro_batch_size=1,
                                 recompute="op"), dict(compute="fp32", grads="fp32"), 0),
    ("llama3-70b_8x8xH100", dict(dp=16, tp=2, cp=2, zero=3, micro_batch_size=1), dict(master_weights=False), 0),
    ("llama3-70b_8x8xH100", dict(dp=8, tp=8, ep=4, zero=2, micro_batch_size=1), {}, 0),
    ("gpt3-175b_128x8xA100", dict(dp=16, pp=8, schedule="1f1b", virtual_stages=1, zero=3), dict(compute="bf16"), 3),
    ("llama3-70b_8x8xH100", dict(dp=64, tp=1, ep=8, zero=1, micro_batch_size=1, sequence_parallel=False),
     dict(optimizer="sgd"), 0),
    ("llama3-70b_8x8xH100", dict(dp=4, tp=2, pp=8, ep=2, zero=1, micro_batch_size=1), {}, 0),
    # fp8 linear layers: tensor-wise under FSDP, row-wise with tensor parallelism, MXFP8
    ("llama3-70b_8x8xH100", dict(dp=64, tp=1, zero=3, micro_batch_size=1, sequence_parallel=False, recompute="op"),
     dict(compute="fp8", recipe="tensorwise", kernels="compiled"), 0),
    ("llama3-70b_8x8xH100", dict(dp=4, tp=4, pp=4, zero=1), dict(compute="fp8", recipe="rowwise_with_gw_hp"), 0),
    ("llama3-70b_8x8xH100", dict(dp=8, tp=8, zero=1), dict(compute="fp8", recipe="mxfp8", kernels="compiled"), 0),
    # offloaded ZeRO-3 (offload="all"): FSDP alone; with tensor parallelism and SGD; under a pipeline (ZeRO-1
    # fallbacks)
    ("llama3-70b_8x8xH100", dict(dp=64, tp=1, zero=3, offload="all", micro_batch_size=1, sequence_parallel=False),
     {}, 0),
    ("llama3-70b_8x8xH100", dict(dp=8, tp=8, zero=3, offload="all", micro_batch_size=1), dict(optimizer="sgd"), 0),
    ("gpt3-175b_128x8xA100", dict(dp=16, pp=8, schedule="1f1b", virtual_stages=1, zero=3, offload="all"),
     dict(compute="bf16"), 3),
    # the optimizer alone in host memory (offload="optimizer"): under ZeRO-1; under ZeRO-0 with tensor parallelism
    # (DeepSpeed and Megatron-LM offload it under ZeRO only: written as ZeRO-1); under a pipeline with ZeRO-2 and
    # SGD (DeepSpeed's pipeline falls back to ZeRO-1; Megatron-LM's CPU offload runs Adam only)
    ("llama3-70b_8x8xH100", dict(dp=64, tp=1, zero=1, offload="optimizer", micro_batch_size=1,
                                 sequence_parallel=False), {}, 0),
    ("llama3-70b_8x8xH100", dict(dp=8, tp=8, zero=0, offload="optimizer", micro_batch_size=1), dict(grads="bf16"), 0),
    ("gpt3-175b_128x8xA100", dict(dp=16, pp=8, schedule="1f1b", virtual_stages=1, zero=2, offload="optimizer"),
     dict(compute="bf16", optimizer="sgd"), 3),
    # the zero-bubble schedules: ZB-H1 (one chunk a device), ZB-V (two, placed as a V), DualPipeV (ZB-V's V, with
    # expert parallelism: torchtitan overlaps its all-to-alls in the pairs unless told not to)
    ("llama3-70b_8x8xH100", dict(dp=4, tp=4, pp=4, schedule="zbh1", zero=1), {}, 0),
    ("gpt3-175b_128x8xA100", dict(dp=16, pp=8, schedule="zbv", virtual_stages=2, zero=0), {}, 0),
    ("llama3-70b_8x8xH100", dict(dp=4, tp=4, pp=4, ep=2, schedule="dualpipev", virtual_stages=2, zero=1,
                                 micro_batch_size=1), {}, 0),
]


def variant_plan(plans: dict[str, autopar.Plan], variant: int) -> autopar.Plan:
    name, changes, precision, shift = VARIANTS[variant]
    plan = plans[name]
    cfg = dataclasses.replace(plan.config, **changes)
    plan = with_partition(plan, even_chunks(plan, cfg.pp * cfg.virtual_stages, shift), **changes)
    return dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, **precision),
                               micro_batches=plan.global_batch_size // (cfg.dp * cfg.micro_batch_size))


CASES = PLANS + [f"variant {i}" for i in range(len(VARIANTS))]


def case_plan(plans: dict[str, autopar.Plan], case: str) -> autopar.Plan:
    return plans[case] if case in plans else variant_plan(plans, int(case.split()[1]))
