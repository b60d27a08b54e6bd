"""Where the cost model's ZeRO-3 pricing has been checked against measured runs, and the plan note that
says when a plan's choice rests on ZeRO-3 beyond it.

ZeRO-3 (FSDP full shard) gathers and reduce-scatters every unit of weights over the data-parallel group
for every micro-batch; at thousands of ranks those rings are latency-bound (comm.py), and the price of
that regime has no measured run behind it: the validation split (bench/data/split.json, fixed before any
fit) holds ZeRO-3 only with tensor parallelism, its largest data-parallel group 32 ranks. A plan whose
ZeRO-3 group is larger and that was chosen over a configuration without ZeRO-3 says so in its notes.
"""

from __future__ import annotations

from ..plan import Plan

# The validation rows (bench/data/published_runs.json, sources of split.json's "validation") that run
# ZeRO-3, with their ZeRO-3 group (dp * cp ranks). tests/unit/cost_model/test_zero3_coverage.py derives
# the same from the data files and fails when they disagree.
VALIDATED_ZERO3_ROWS: tuple[tuple[str, int], ...] = (
    ("torchtitan 70B 256 GPUs fsdp32 tp8 compiled", 32),
    ("torchtitan 8B 64 GPUs fsdp8 tp8 compiled", 8),
)
LARGEST_VALIDATED_ZERO3_GROUP = max(group for _, group in VALIDATED_ZERO3_ROWS)


def zero3_scaling_note(plan: Plan) -> str | None:
    """A note when ``plan`` runs ZeRO-3 over more ranks than any validation run and one of its
    alternatives without ZeRO-3 fits but priced slower: the choice rests on ZeRO-3 pricing no measured
    run covers. None otherwise (an estimate has no alternatives, so never a note)."""
    cfg = plan.config
    group = cfg.grad_replicas
    if cfg.zero < 3 or group <= LARGEST_VALIDATED_ZERO3_GROUP:
        return None
    beaten = [a for a in plan.alternatives if a.fits and a.config.zero < 3 and a.step_time > plan.step_time]
    if not beaten:
        return None
    rival = min(beaten, key=lambda a: a.step_time)
    row, size = max(VALIDATED_ZERO3_ROWS, key=lambda r: r[1])
    lead = rival.step_time / plan.step_time - 1
    return (f"this plan's ZeRO-3 group of {group} ranks is larger than any validation run's "
            f"({size}: {row!r}, bench/data/split.json): its {100 * lead:.1f}% lead over {rival.config.short()} "
            f"rests on ZeRO-3 collective pricing at a scale no measured run checks; "
            f"the all-gathers and reduce-scatters of a group this size are latency-bound and may cost more")
