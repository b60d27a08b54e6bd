"""The data-parallel bucket rule, standard library only: the runtime's GradReducer (data_parallel.py) and the
cost model's StepTail (cost_model/step_tail.py) read the same function, so the buckets priced are the ones
that run."""

from __future__ import annotations

DDP_BUCKET_BYTES = 25 * 2 ** 20       # PyTorch DDP's default bucket_cap_mb
BUCKET_ELEMENTS_PER_RANK = 1_000_000   # Megatron-Core's growth of its buckets with the group


def dp_bucket_bytes(ranks: int, element_bytes: int) -> int:
    """Bytes of gradients per data-parallel bucket (one collective each) over a group of ``ranks``:
    DDP's 25 MB, grown with the group as Megatron-Core grows its buckets (1M elements per rank,
    ``DistributedDataParallelConfig.bucket_size``) so that each collective of a large group stays
    bound by bandwidth rather than by its ring's ``ranks - 1`` step latencies. The runtime's
    GradReducer and the cost model's StepTail.dp_time both use it."""
    return max(DDP_BUCKET_BYTES, BUCKET_ELEMENTS_PER_RANK * ranks * element_bytes)
