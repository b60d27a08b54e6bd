"""autopar's runtime library: what a rank runs, with torch alone.

The pipeline executor and its checked schedules (pipeline.py, schedules.py), the tensor-parallel
collectives with Megatron's gradient convention (collectives.py) and the sharded ops (shard_ops.py),
context parallelism (context_state.py, context_ops.py, ring_attention.py), data parallelism's gradient
reduction and ZeRO via FSDP2 (data_parallel.py), expert parallelism (expert_parallel.py, experts.py),
checkpoints (dcp_state.py), recomputation (recompute.py), the compiled optimizer step (optim.py),
sharded initialisation (sharded_init.py), failures with deadlines (failures.py), a CPU rank's heap
(host_heap.py) and the one Mesh (mesh.py). codegen/ compiles a plan into what these run; driver/ (``autopar.parallelize``) and a
standalone folder's train.py drive them.

:data:`STANDALONE` are the modules that import only torch, the standard library and each other (fp8.py
imports torchao too, when an fp8 program builds its linear layers: a folder of a bf16 plan never does): a
standalone folder carries them as the package ``autopar_runtime`` (:func:`vendor`), so generated code
and train.py import the same files ``autopar.parallelize`` runs. This file imports nothing else.
"""

from __future__ import annotations

import os
import shutil

STANDALONE = ("batches", "buckets", "collectives", "context_ops", "context_state", "data_parallel", "dcp_state",
              "failures", "fp8", "host_heap", "losses", "mesh", "optim", "pipeline", "recompute", "ring_attention", "shard_ops",
              "sharded_init")
VENDORED = "autopar_runtime"
"""The package name a folder's copy has (not ``autopar``: it must not hide an installed autopar)."""

_HERE = os.path.dirname(os.path.abspath(__file__))


def vendor(folder: str) -> str:
    """Copy the :data:`STANDALONE` modules into ``folder/autopar_runtime/`` with autopar/errors.py as its
    errors.py; returns the package's path."""
    out = os.path.join(folder, VENDORED)
    os.makedirs(out, exist_ok=True)
    for name in STANDALONE:
        shutil.copyfile(os.path.join(_HERE, f"{name}.py"), os.path.join(out, f"{name}.py"))
    shutil.copyfile(os.path.join(os.path.dirname(_HERE), "errors.py"), os.path.join(out, "errors.py"))
    with open(os.path.join(out, "__init__.py"), "w") as fh:
        fh.write('"""autopar\'s runtime library (autopar/runtime), copied: torch alone."""\n')
    return out
