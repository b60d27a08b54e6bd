"""The source a rank's program writes (Program.source, codegen/source.py) is the code it runs: imported
from the written file beside its copy of the runtime library, autopar_runtime/ (torch alone), each layer's
class computes exactly what the in-process layer computes on the same arguments, on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import re
import os
import sys
import tempfile
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Case, batches, fresh, loss_fn_of, run_cases  # noqa: E402

BASE_CONFIG = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b",
                   virtual_stages=1, sequence_parallel=False)

CASES = [
    # collectives of tensor and sequence parallelism, the vocabulary-parallel embedding and loss,
    # selective recompute's checkpointed core as a class of its own
    Case("gpt-tp2_sp_selective-source", "gpt", {**BASE_CONFIG, "tp": 2, "micro_batch_size": 2,
                                                 "sequence_parallel": True, "recompute": "selective"}, 2),
    # Hugging Face Llama: rotary embedding's no_grad / autocast regions inlined, pipeline stages
    Case("llama-pp2-source", "llama", {**BASE_CONFIG, "pp": 2}, 2),
]


def source_case(rank: int, world: int, case: Case, plan_dict: dict) -> dict[str, Any]:
    import autopar
    from autopar.codegen.layers import class_name
    program = autopar.parallelize(fresh(case.model), autopar.Plan.from_dict(plan_dict),
                                  loss_fn=loss_fn_of(case.model), timeout=60)
    calls: dict[str, tuple] = {}
    layers = [layer for c in program.my_chunks for layer in program.chunks[c].layers]
    for layer in layers:
        def record(*args, _layer=layer, _run=layer.program):
            calls[_layer.spec.name] = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            return _run(*args)
        layer.__dict__["program"] = record
    program.forward_backward(batches(case.model, 1, case.global_batch)[0])
    with tempfile.TemporaryDirectory() as folder:
        path = program.write_source(folder, f"stage{program.pp_rank}.py")
        text = open(path).read()
        sys.path.insert(0, folder)
        try:
            spec = importlib.util.spec_from_file_location(f"generated_stage_{rank}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(folder)
            for name in [n for n in sys.modules if n.split(".")[0] == "autopar_runtime"]:
                sys.modules.pop(name)   # the folder's copy of the runtime library
    group = program.node_runner.group
    differ = []
    with torch.no_grad():
        for layer in layers:
            args = calls[layer.spec.name]
            want = layer.generated(*args)
            got = getattr(module, class_name(layer.spec.name))(tp_group=group)(*args)
            if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
                differ.append(layer.spec.name)
    return {"differ": differ, "layers": len(layers), "text": text}


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, 2, function="test_source:source_case")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_written_source_computes_what_runs(results, case):
    for rank, got in enumerate(r[case.name] for r in results):
        assert "error" not in got, got.get("error")
        assert got["layers"] > 0 and got["differ"] == [], (rank, got["differ"])
        text = got["text"]
        assert not re.search(r"^\s*(from|import) autopar\b(?!_runtime)", text, re.M), "the source imports autopar"
        assert "from autopar_runtime import collectives, shard_ops" in text
        if "tp2" in case.name:
            assert "collectives.gather_partial(" in text and "shard_ops.vocab_cross_entropy(" in text
            assert "_recompute_0(torch.nn.Module)" in text and "checkpoint(recompute_0" in text
        assert "# " in text   # module paths of the model's code
