"""``emit(..., standalone=True)`` compiles a plan into a folder that trains with torch alone: run under
torchrun on 2 gloo ranks with an import hook that refuses autopar, a Hugging Face Llama built by a
factory that imports only transformers, planned from batch-1 example inputs as the README shows,
at tp=2 (+ sequence parallelism), pp=2 1F1B, dp=2 ZeRO-3, cp=2 (ring attention), pp=2 of a model
built on the meta device (each rank gives values to what it holds, equal to autopar.init_weights),
pp=2 of a plain-torch regressor whose loss_fn reads targets and a mask its forward does not take
(they reach the last stage's loss), pp=2 ZB-V (the split backward, a four-block Llama), tp=2 of an fp8 plan
(torchao's float8 training, emulated, against one process converted alike); and on 4 ranks tp=2 x dp=2
ZeRO-3, FSDP2 sharding each tensor-parallel shard again over the data-parallel ranks (checkpointed on the
(dp, tp) mesh), tp=2 x pp=2 (the residual stream crossing the cut as each rank's half, all-gathered), and,
in make bench, cp=2 x tp=2: its
losses equal one process's (fp32, relative 1e-5: only the order of additions differs). Each run
stops after step 1 with a checkpoint and a second run resumes from it: the losses of the steps after
(AdamW's state included) are still equal, and ``autopar.load_checkpoint`` reads that checkpoint
into one process equal to the reference after its first step. Every run clips its gradients to a total
norm below theirs (``--clip-grad``): each step's printed norm is one process's, whatever the ranks hold."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import plain_factories  # noqa: E402
from harness import free_port  # noqa: E402
from suite import ALL_CASES  # noqa: E402

STEPS, GLOBAL, LR = 3, 4, 1e-3   # a checkpoint after step 1, resumed for steps 2 and 3
CLIP = 0.05   # --clip-grad: below every step's norm, so every step is clipped (its norm printed, compared)
BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=4, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
CASES = {   # name -> (ranks, pinned fields)
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True, recompute="op")),
    "pp2_1f1b": (2, dict(pp=2, micro_batch_size=1)),
    "dp2_zero3": (2, dict(dp=2, zero=3, micro_batch_size=2)),
    # ZeRO-1: each replica keeps and steps the states of its share, checkpointed and resumed by their owners
    "dp2_zero1": (2, dict(dp=2, zero=1, micro_batch_size=2)),
    "cp2": (2, dict(cp=2, micro_batch_size=2)),   # ring attention; gradients averaged over the cp ranks
    # built on the meta device: each stage gives values to its own parameters and buffers (rotary tables)
    "pp2_meta": (2, dict(pp=2, micro_batch_size=2)),
    "pp2_targets": (2, dict(pp=2, micro_batch_size=1)),   # loss_fn reads batch keys forward does not take
    # ZB-V: the split backward (I, W) and its V (chunks 0 and 3, the loss, on pipeline rank 0) in train.py
    "pp2_zbv": (2, dict(pp=2, micro_batch_size=1, schedule="zbv", virtual_stages=2)),
    # DualPipeV: ZB-V's V, whole backwards (B) in its steady pairs and split ones (I, W) in its warm-up and drain,
    # under full recomputation (each split pass reruns the forward, a whole backward once)
    "pp2_dualpipev": (2, dict(pp=2, micro_batch_size=1, schedule="dualpipev", virtual_stages=2, recompute="full")),
    # fp8 linear layers (torchao's float8 training, emulated on this CPU) on tensor-parallel shards: row-wise
    # scales (one token's or channel's each), whose amax the runtime all-reduces where tp splits it
    "tp2_fp8": (2, dict(tp=2, micro_batch_size=2)),
    # the optimizer offloaded (optim.MasterOptimizer over FSDP2's shards): stepped on host copies, checkpointed
    # and resumed through them
    "dp2_zero3_offload": (2, dict(dp=2, zero=3, micro_batch_size=2, offload="optimizer")),
    # tensor-wise fp8 under ZeRO-3: FSDP2 gathers the linear weights in fp8 (FP8_GATHERED), each shard cast with
    # the whole weight's scale; the activations' scales are each rank's rows' (one process runs them as calls)
    "dp2_zero3_fp8_gathered": (2, dict(dp=2, zero=3, micro_batch_size=2)),
}
PRECISION = {"tp2_fp8": dict(compute="fp8", recipe="rowwise_with_gw_hp", fp8_storage="fp32"),   # fp32 models
             "dp2_zero3_fp8_gathered": dict(compute="fp8", recipe="tensorwise", fp8_storage="fp32")}
CALLS = {"dp2_zero3_fp8_gathered": 2}   # one process runs each step's batch as this many calls (a rank's rows each)   # the plan edited to it (this CPU has
# no fp8 peak to price it with: what runs is what this case tests), the reference converted alike
FACTORY = {name: "llama_on_meta" if name.endswith("_meta") else "tagger" if name.endswith("_targets") else
           "llama4" if name.endswith(("_zbv", "_dualpipev")) else "llama" for name in CASES}
BATCH = {"tagger": "tagger_batch"}   # factory -> its batch factory (default llama_batch) and loss_fn (default:
LOSS = {"tagger": "tagger_loss"}     # the model's own), all in plain_factories
# a second torchrun, of 4 ranks: ZeRO-3 over tensor-parallel blocks (their checkpoint layout) and tp x pp (the
# residual stream crossing scattered); cp x tp too under make bench (4 processes on 2 cores)
CASES["tp2_dp2_zero3"] = (4, dict(tp=2, dp=2, zero=3, micro_batch_size=2, sequence_parallel=True))
CASES["tp2_pp2"] = (4, dict(tp=2, pp=2, micro_batch_size=2))
FACTORY.update(tp2_dp2_zero3="llama", tp2_pp2="llama")
if ALL_CASES:
    CASES["cp2_tp2"] = (4, dict(cp=2, tp=2))
    FACTORY.update(cp2_tp2="llama")


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    """A folder whose sitecustomize.py refuses autopar in every process started with it on PYTHONPATH."""
    folder = tmp_path_factory.mktemp("no_autopar")
    (folder / "sitecustomize.py").write_text(plain_factories.REFUSE_AUTOPAR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), HERE]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import autopar"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "cannot be imported here" in probe.stderr
    return env


def _one_process(factory: str, recipe: str | None = None, calls: int = 1):
    """One process's losses and the weights after its first step: the factory's model under
    torch.manual_seed(0), or a meta-built one given the values every plan gives it (init_weights, seed 0);
    with ``recipe``, its linear layers converted to torchao's float8 training as an fp8 plan runs them; each
    step's batch run as ``calls`` calls of its consecutive rows (their mean loss)."""
    from autopar.runtime.batches import slice_batch
    import autopar
    from autopar.capture.export import LossWrapper
    from harness import to_fp8
    torch.manual_seed(0)
    model = getattr(plain_factories, factory)()
    if factory.endswith("_meta"):
        model = autopar.init_weights(model, seed=0)
    if recipe is not None:
        to_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out, norms, after_first = [], [], None
    for step in range(STEPS):
        opt.zero_grad()
        batch = _batch(factory, step, GLOBAL)
        parts = [slice_batch(batch, k * GLOBAL // calls, (k + 1) * GLOBAL // calls, GLOBAL) for k in range(calls)]
        loss = torch.stack([LossWrapper(model, _loss_fn(factory), part)(**part) for part in parts]).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        out.append(loss.item())
        if step == 0:
            after_first = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out, norms, after_first


def _batch(factory: str, step: int, size: int) -> dict:
    return getattr(plain_factories, BATCH.get(factory, "llama_batch"))(step, size)


def _loss_fn(factory: str):
    return getattr(plain_factories, LOSS[factory]) if factory in LOSS else None


@pytest.fixture(scope="module")
def references():
    """By case: its one-process reference (cases of one factory and precision share theirs)."""
    out: dict = {}
    key = {name: (FACTORY[name], PRECISION.get(name, {}).get("recipe"), CALLS.get(name, 1)) for name in CASES}
    for name in CASES:
        if key[name] not in out:
            out[key[name]] = _one_process(*key[name])
    return {name: out[key[name]] for name in CASES}


@pytest.fixture(scope="module")
def reference(references):
    return references["pp2_1f1b"]   # the llama's, in fp32


DRIVER = '''import os, runpy, sys

import torch.distributed as dist

# Each folder's train.py in turn, in this process and process group (one torchrun for all: spawning
# costs seconds); train.py leaves a process group it did not make as it found it.
dist.init_process_group("gloo")
for item in sys.argv[1:]:
    folder, losses = item.split("=")
    for name in [n for n in sys.modules if n == "program" or n.split(".")[0] == "autopar_runtime"]:
        sys.modules.pop(name)   # this folder's own program.py and runtime library
    common = ["--loss-file", losses, "--timeout", "120", "--clip-grad", "CLIP"]
    if dist.get_rank() == 0:   # what rank 0's steps print below is this folder's
        print("folder", folder, flush=True)
    ckpt = os.path.join(folder, "ckpt")
    # step 1 and a checkpoint, then a second run from it to the end
    for tail in (["--steps", "1", "--checkpoint", ckpt], ["--steps", "STEPS", "--resume", ckpt]):
        sys.argv = [os.path.join(folder, "train.py"), *common, *tail]
        runpy.run_path(sys.argv[0], run_name="__main__")
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(hook, tmp_path_factory):
    """Every case's folder (emitted here, where autopar is imported), then one torchrun per world size that
    trains each in turn where autopar cannot be imported; case -> (program.py's text, rank 0's losses)."""
    import autopar
    from autopar import Cluster
    root = tmp_path_factory.mktemp("standalone")
    texts, items, printed = {}, {}, {}
    torch.manual_seed(0)
    for name, (world, config) in CASES.items():
        factory = FACTORY[name]
        example = {k: v[:1] for k, v in _batch(factory, 0, GLOBAL).items()}
        model = getattr(plain_factories, factory)()   # a meta one planned on meta, as the README shows
        plan = autopar.plan(model, Cluster.from_spec(f"1x{world}xcpu"), example, global_batch_size=GLOBAL,
                            fixed={**BASE, **config}, loss_fn=_loss_fn(factory), verbose=False)
        if name in PRECISION:
            plan = dataclasses.replace(plan, precision=autopar.Precision(**PRECISION[name]))
        autopar.codegen.emit(plan, root / name, f"plain_factories:{factory}",
                             batch_factory=f"plain_factories:{BATCH.get(factory, 'llama_batch')}",
                             loss_fn=f"plain_factories:{LOSS[factory]}" if factory in LOSS else None, lr=LR,
                             standalone=True)
        texts[name] = (root / name / "program.py").read_text()
        items.setdefault(world, []).append(f"{root / name}={root / (name + '.losses')}")
    driver = root / "driver.py"
    driver.write_text(DRIVER.replace("STEPS", str(STEPS)).replace("CLIP", str(CLIP)))
    for world, folders in items.items():
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                              "--master-port", str(free_port()), str(driver), *folders], env=hook, cwd=root,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        printed[world] = run.stdout
    return {name: (texts[name], [float(x) for x in (root / (name + ".losses")).read_text().split()],
                   root / name / "ckpt" / "step00000001", printed[CASES[name][0]]) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_standalone_program_trains_like_one_process(name, runs, references):
    import autopar
    text, got, checkpoint, printed = runs[name]
    losses, norms, after_first = references[name]
    assert "import autopar" not in text and "class Chunk0(torch.nn.Module)" in text
    if name.startswith("tp2") and CASES[name][1].get("sequence_parallel"):
        assert "collectives.gather_partial(" in text and "collectives.reduce_scatter(" in text
    if name.endswith("_meta"):   # the rotary tables: given values on each rank, not in buffers.pt
        assert "META_BUFFERS = {'b_model_model_rotary_emb_inv_freq'" in text
    # the folder carries the runtime library (autopar_runtime/); the program imports context parallelism's
    # ops when it calls them, and only then
    assert (checkpoint.parents[1] / "autopar_runtime" / "ring_attention.py").exists()
    assert ("from autopar_runtime import context_ops" in text) == name.startswith("cp2")
    if name.startswith("cp2"):
        assert "context_ops.ring(" in text and "CONTEXT_INPUTS = {" in text
    assert ("FP8_GATHERED = []" in text) != (name == "dp2_zero3_fp8_gathered")
    if name in PRECISION:   # the linear layers through the runtime library's torchao float8 module
        assert f"FP8_RECIPE = {PRECISION[name]['recipe']!r}" in text and "self.fp8_linear(" in text
        assert (checkpoint.parents[1] / "autopar_runtime" / "fp8.py").exists()
    else:
        assert "FP8_RECIPE = None" in text and "fp8_linear" not in text
    if name.endswith(("_zbv", "_dualpipev")):
        assert "CHUNK_DEVICES = [0, 1, 1, 0]" in text and "SPLIT_BACKWARD = True" in text
        assert "I3.0" in text and "W0.3" in text
    if name.endswith("_dualpipev"):
        assert "B3.1" in text and "B0.0" in text
    assert (f"OFFLOAD, MASTER_WEIGHTS = {CASES[name][1].get('offload', 'none')!r}," in text)
    assert f"ZERO, MICRO_BATCH_SIZE, MICRO_BATCHES, GLOBAL_BATCH = {CASES[name][1].get('zero', 0)}," in text
    if name == "dp2_zero1":   # the states partitioned as the plan priced them, not kept whole on every replica
        kept = re.findall(r"ZeRO-1: rank 0 keeps the optimizer states of (\d+) of its (\d+) parameters", printed)
        assert kept and all(0 < int(a) < int(b) for a, b in kept), printed[-2000:]
    if "zero3" in name:   # the FSDP2 units the cost model priced: each block; embedding, final norm and
        # head (small) in the chunk's root unit
        assert "UNITS = {0: [([1], False), ([2], False)]}" in text
    assert len(got) == STEPS
    for g, w in zip(got, losses):
        assert math.isclose(g, w, rel_tol=1e-5), (got, losses)
    # --clip-grad: each step's norm of the whole model's gradients, as one process's (then clipped alike)
    mine = printed.split(f"folder {checkpoint.parents[1]}\n")[1].split("\nfolder ")[0]
    printed_norms = [float(x) for x in re.findall(r"^step \d+ loss \S+ grad norm (\S+)$", mine, re.M)]
    assert min(norms) > CLIP and len(printed_norms) == STEPS, (norms, mine[-2000:])
    for g, w in zip(printed_norms, norms):
        assert math.isclose(g, w, rel_tol=1e-5), (printed_norms, norms)
    # autopar's own loader reads the folder's checkpoint into one process
    model = getattr(plain_factories, FACTORY[name].removesuffix("_on_meta"))()
    assert autopar.load_checkpoint(str(checkpoint), model) == 1
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), after_first[n], rtol=0, atol=1e-5, msg=n)


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1): a world of its own")
def test_parallelize_resumes_a_standalone_checkpoint_under_another_plan(runs, reference):
    """The tp=2 folder's checkpoint after step 1, read by ``autopar.parallelize`` at dp=2 (DCP
    reshards each block to whole replicas) and trained on: steps 2 and 3 equal one process's."""
    import autopar
    import worlds
    from autopar import Cluster
    example = {k: v[:1] for k, v in plain_factories.llama_batch(0, GLOBAL).items()}
    plan = autopar.plan(plain_factories.llama(), Cluster.from_spec("1x2xcpu"), example, global_batch_size=GLOBAL,
                        fixed={**BASE, "dp": 2, "micro_batch_size": 2}, verbose=False)
    got = worlds.world(2).run("checkpoint_cases:resume_standalone", plan.to_dict(), str(runs["tp2_sp"][2]), STEPS,
                              GLOBAL, LR, CLIP)
    for per_rank in got:
        assert len(per_rank) == STEPS - 1
        for g, w in zip(per_rank, reference[0][1:]):
            assert math.isclose(g, w, rel_tol=1e-5), (per_rank, reference[0])


@pytest.mark.parametrize("fixed, says", [({"cp": 2}, "MoE regions as one call, as context parallelism"),
                                         ({"dp": 2, "ep": 2}, "expert parallelism")])
def test_refuses_what_it_cannot_run_yet_saying_what_to_do(tmp_path, fixed, says):
    """Expert parallelism, and an MoE model under context parallelism (both run MoE regions as one
    call, which the folder cannot yet), are refused at emit time, naming the way that runs them."""
    import autopar
    from autopar import Cluster
    example = {k: v[:1] for k, v in plain_factories.llama_batch(0, GLOBAL).items()}
    plan = autopar.plan(plain_factories.mixtral(), Cluster.from_spec("1x2xcpu"), example, global_batch_size=GLOBAL,
                        fixed={**BASE, "micro_batch_size": 2, **fixed}, verbose=False)
    with pytest.raises(autopar.ConfigError, match=f"cannot run {says}.*standalone=False"):
        autopar.codegen.emit(plan, tmp_path / "run", "plain_factories:mixtral", standalone=True)
