"""A fixed sample of the Hugging Face registry sweep (bench/hf_coverage.py runs all of it): each
architecture built at the test size by autopar/models/shrink.py, planned on the meta device from a
batch-1 example with one configuration pinned, and trained on the session's 2-rank world equal to
one process (hf_sweep.judge: test_parallelize's tolerances).

- MambaForCausalLM at tp=2: its in_proj output is transposed to channels-first and cut into gate,
  x, B, C and dt (strided shards, which DTensor's composite ops could not view: the refusal that
  blocked tensor parallelism on 9 architectures of the sweep), and its dt_proj is a matmul with the
  weight on the left (``W @ x``), which the planner must not split as ``x @ W``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import hf_sweep  # noqa: E402

SAMPLE = [("MambaForCausalLM", "tp")]


@pytest.mark.parametrize("name,config", SAMPLE, ids=[f"{n}-{c}" for n, c in SAMPLE])
def test_trains_equal_to_one_process(name, config):
    import worlds
    from autopar.models.shrink import architectures
    arch = next(a for a in architectures() if a.name == name)
    plans = hf_sweep.pinned_plans(arch, [config])
    per_rank = worlds.world(2).run("hf_sweep:run_arch", arch, plans)
    cell = hf_sweep.judge(arch, plans, per_rank)[config]
    assert cell.status == "ok", (cell, per_rank[0][config].get("trace"))
