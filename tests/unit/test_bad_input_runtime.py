"""The runtime's guarantees on one gloo rank in this process (the multi-rank ones, a dead or silent
peer, are in tests/distributed/test_failures.py): a non-finite loss stops the step naming its
micro-batch, an error inside a step becomes a RuntimeFailure naming the rank and the step,
full_state_dict round-trips through torch.save into the single-device model, and mismatched plans,
batches and arguments are refused naming the culprit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar import Cluster, ConfigError, PlanMismatchError, RuntimeFailure

ONE = Cluster.from_spec("1x1xcpu")
BATCH = 4


class Tied(nn.Module):
    """Two linears sharing one weight, a persistent and a non-persistent buffer, and a parameter no
    op reads: everything a state_dict round trip can get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.scale)


def loss_fn(out, inputs):
    return out.pow(2).mean()


def make_model() -> Tied:
    torch.manual_seed(0)
    return Tied()


def batch(seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(seed)),)


@pytest.fixture(scope="module")
def world(one_rank_world):
    return None


@pytest.fixture(scope="module")
def plan():
    return autopar.plan(make_model(), ONE, batch(), global_batch_size=BATCH, fixed={"micro_batch_size": 1},
                        loss_fn=loss_fn, verbose=False)


def program(plan, model=None, **kwargs):
    return autopar.parallelize(model or make_model(), plan, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                               loss_fn=loss_fn, **kwargs)


def test_full_state_dict_round_trips_through_torch_save(world, plan, tmp_path) -> None:
    prog = program(plan)
    for seed in range(2):
        prog.train_step(batch(seed))
    path = tmp_path / "model.pt"
    torch.save(prog.full_state_dict(), path)
    restored = make_model()
    restored.load_state_dict(torch.load(path), strict=True)   # every key, tied names and buffers included
    reference = make_model()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for seed in range(2):
        opt.zero_grad()
        loss_fn(reference(*batch(seed)), None).backward()
        opt.step()
    for (name, p), (_, q) in zip(reference.state_dict().items(), restored.state_dict().items()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert restored.b.weight is restored.a.weight   # still tied after the load


def test_non_finite_loss_names_the_micro_batch(world, plan) -> None:
    prog = program(plan)
    prog.train_step(batch(0))
    before = copy.deepcopy(prog.full_state_dict())
    bad = batch(1)[0].clone()
    bad[2, 3] = float("nan")
    with pytest.raises(RuntimeFailure, match=r"rank 0, step 1: the loss of micro-batch 2 of data-parallel "
                                             r"replica 0 \(samples 2\.\.2 of the global batch\) is nan"):
        prog.train_step((bad,))
    after = prog.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a step with a non-finite loss changed weights"
    prog.train_step(batch(2))   # the program goes on with good data
    assert torch.isfinite(prog.micro_losses).all()


def test_error_inside_a_step_names_rank_and_step(world, plan, monkeypatch) -> None:
    prog = program(plan)
    prog.train_step(batch(0))

    def boom(*args, **kwargs):
        raise RuntimeError("boom in a collective")
    monkeypatch.setattr(prog.runner, "run", boom)
    with pytest.raises(RuntimeFailure, match=r"^rank 0, step 1: forward_backward failed with RuntimeError: boom") \
            as info:
        prog.train_step(batch(1))
    assert isinstance(info.value.__cause__, RuntimeError)   # the original, with its traceback


def test_plan_for_another_model(world, plan) -> None:
    class Wider(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
    with pytest.raises(PlanMismatchError,
                       match=r"fingerprint.*Wider.*parameter a\.bias \[8\] is not read here.*re-plan"):
        program(plan, Wider())


def test_plan_made_by_an_older_autopar(world, plan) -> None:
    """A plan of schema 1 loads (to show or compare it) but its fingerprint hashed the exported graph,
    which this autopar does not compute: parallelize refuses it, saying to re-plan."""
    data = {**plan.to_dict(), "schema_version": 1}
    del data["structure"]
    old = autopar.Plan.from_dict(data)
    assert old.structure is None
    with pytest.raises(PlanMismatchError, match=r"schema 1.*older autopar.*re-plan"):
        program(old)


def test_plan_for_more_devices(world, plan) -> None:
    two = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=2))
    with pytest.raises(PlanMismatchError, match=r"2 devices.*1 ranks.*--nproc-per-node 2"):
        program(two)


def test_batch_of_the_wrong_size(world, plan) -> None:
    prog = program(plan)
    with pytest.raises(ConfigError, match=str(BATCH)):
        prog.train_step((torch.randn(BATCH + 1, 8),))
    with pytest.raises(ConfigError, match=r"input 0 is \[4, 9\], but the plan was made for \[batch, 8\]"):
        prog.train_step((torch.randn(BATCH, 9),))


@pytest.mark.parametrize("timeout", [0, -5, "1s"])
def test_bad_timeout(world, plan, timeout) -> None:
    with pytest.raises(ConfigError, match=f"timeout.*{timeout!r}"):
        program(plan, timeout=timeout)


def test_train_step_without_optimizer(world, plan) -> None:
    prog = autopar.parallelize(make_model(), plan, loss_fn=loss_fn)
    with pytest.raises(ConfigError, match="train_step needs an optimizer"):
        prog.train_step(batch())


def test_recompute_layers_checkpoints_the_first_layers_of_each_chunk(world) -> None:
    """recompute_layers=1: the program recomputes the chunk's first layer only, and trains as one
    process does (recomputation changes no number)."""
    plan = autopar.plan(make_model(), ONE, batch(), global_batch_size=BATCH, loss_fn=loss_fn, verbose=False,
                        fixed={"micro_batch_size": 1, "recompute": "full", "recompute_layers": 1})
    assert plan.config.recompute_layers == 1
    prog = program(plan)
    (chunk,) = prog.chunks.values()
    assert len(chunk.layers) > 1 and [m.recompute for m in chunk.layers] == ["full"] + ["none"] * (len(chunk.layers) - 1)
    loss = prog.forward_backward(batch(0))
    reference = make_model()
    want = sum(loss_fn(reference(x[None]), None) for x in batch(0)[0]) / BATCH
    assert torch.allclose(loss, want, atol=1e-6)


def test_parallelize_refuses_a_plan_priced_with_fused_accumulation(world, plan) -> None:
    """A plan that priced its micro-batches' gradients accumulated inside the GEMMs (Megatron-LM's fusion) would
    run slower than priced here, where autograd adds them: refused, saying what to re-plan with."""
    assert plan.micro_batches > 1 and plan.precision.grad_accumulation == "autograd"
    fused = dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, grad_accumulation="fused"))
    with pytest.raises(ConfigError, match=r"Precision\(grad_accumulation='autograd'\)"):
        program(fused)


def test_compile_follows_the_plans_kernels(world, plan) -> None:
    """A plan priced for torch.compile's kernels is compiled by default (each chunk after the first step,
    which runs the shape-checked code), an eager one is not; compile= overrides either; a bad value is
    refused by name."""
    compiled = dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, kernels="compiled"))
    assert program(compiled).compile == "inductor"
    assert program(plan).compile is None
    assert program(plan, compile="aot_eager").compile == "aot_eager"
    assert program(compiled, compile=False).compile is None
    with pytest.raises(ConfigError, match="compile must be"):
        program(plan, compile=3)
    prog = program(plan, compile="eager")   # dynamo without a compiler: the chunk is compiled after step 1
    first = prog.train_step(batch(0))
    assert all(chunk._compiled_call_impl is not None for chunk in prog.chunks.values())
    assert torch.isfinite(first) and torch.isfinite(prog.train_step(batch(1)))


# --- the plan's loss (capture/loss.py) ------------------------------------------------------------
LOSS_NAME = f"{loss_fn.__module__}:loss_fn"


def test_parallelize_refuses_a_missing_or_another_loss_fn(world, plan) -> None:
    """A plan made with loss_fn: without it the model's output mean would be trained on (the U-Net of
    issue 48 trained on -0.20 instead of 1.05), with another loss_fn another loss."""
    with pytest.raises(PlanMismatchError, match=f"given no loss_fn: pass loss_fn={LOSS_NAME} to autopar.parallelize"):
        autopar.parallelize(make_model(), plan)
    with pytest.raises(PlanMismatchError, match=f"given loss_fn=.*<lambda>: pass loss_fn={LOSS_NAME}"):
        autopar.parallelize(make_model(), plan, loss_fn=lambda out, inputs: out.pow(2).mean())
    assert plan.loss.name == LOSS_NAME


@pytest.fixture(scope="module")
def stand_in():
    """A plan of the model without loss_fn: priced with the mean of its output."""
    return autopar.plan(make_model(), ONE, batch(), global_batch_size=BATCH, fixed={"micro_batch_size": 1},
                        verbose=False)


def test_parallelize_refuses_a_stand_in(world, stand_in) -> None:
    with pytest.raises(PlanMismatchError, match=r"stand-in loss.*cannot train.*labels in example_inputs.*loss_fn="):
        autopar.parallelize(make_model(), stand_in)
    with pytest.raises(PlanMismatchError, match=f"stand-in.*re-plan with loss_fn={LOSS_NAME}"):
        autopar.parallelize(make_model(), stand_in, loss_fn=loss_fn)
    assert stand_in.loss.kind == "stand-in"


def test_a_plan_without_its_loss_record_refuses_a_stand_in(world, plan) -> None:
    """A plan written before the loss was recorded loads; the rank's own export shows a stand-in."""
    data = plan.to_dict()
    data.pop("loss", None)
    old = autopar.Plan.from_dict(data)
    with pytest.raises(PlanMismatchError, match=r"returns no loss.*pass the loss_fn the plan was made with"):
        autopar.parallelize(make_model(), old)
    assert old.loss is None
    program(old).train_step(batch())


class Tagger(nn.Module):
    """forward(x) returns per-token predictions; its loss reads targets and a mask forward does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def tagger_loss(out, inputs):
    mask = inputs["mask"].float()
    return ((out - inputs["targets"]).pow(2).mean(-1) * mask).sum() / mask.sum().clamp(min=1.0)


def test_loss_fn_reads_keys_forward_does_not_take(world) -> None:
    """Targets and a mask reach loss_fn, micro-batched (micro-batches of 2 from an example batch of 8), never
    forward; the loss and gradients are one process's over the same micro-batches."""
    g = torch.Generator().manual_seed(0)
    data = {"x": torch.randn(8, 5, 8, generator=g), "targets": torch.randn(8, 5, 3, generator=g),
            "mask": torch.rand(8, 5, generator=g) > 0.3}
    torch.manual_seed(0)
    model = Tagger()
    plan = autopar.plan(model, ONE, data, global_batch_size=8, fixed={"micro_batch_size": 2}, loss_fn=tagger_loss,
                        verbose=False)
    assert plan.micro_batches == 4
    prog = autopar.parallelize(model, plan, loss_fn=tagger_loss)
    loss = prog.forward_backward(data)
    grads = prog.full_grads()
    parts = [{k: v[i:i + 2] for k, v in data.items()} for i in range(0, 8, 2)]
    want = sum(tagger_loss(model(p["x"]), p) for p in parts) / len(parts)
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6)   # the same ops in the same order: fp32 rounding only
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name


def test_parallelize_refuses_a_plan_priced_with_overlapped_param_gather(world, plan) -> None:
    """A ZeRO-1 plan that priced the updated weights' gather hidden under the next forward (Megatron-Core's
    --overlap-param-gather) would run slower than priced here, where they are broadcast after the step: refused,
    saying what to re-plan with, before anything is built: by compile_program, which parallelize and the standalone
    folder both compile through (called here as they call it, so that two replicas need no two ranks)."""
    zero1 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=2, zero=1),
                                precision=dataclasses.replace(plan.precision, param_gather="overlapped"))
    from autopar.codegen.compile import compile_program
    with pytest.raises(ConfigError, match=r"Precision\(param_gather='after_step'\)"):
        compile_program(zero1, None, make_model())


def test_parallelize_refuses_a_plan_priced_with_all_reduced_zero1_gradients(world, plan) -> None:
    """A ZeRO-1 plan priced with DeepSpeed 0.4.4-0.12's all-reduce of the gradients would run faster than priced
    here, where each owner receives its shard's sum: refused, saying what to re-plan with."""
    zero1 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=2, zero=1),
                                precision=dataclasses.replace(plan.precision, grad_reduce="all_reduce"))
    from autopar.codegen.compile import compile_program
    with pytest.raises(ConfigError, match=r"Precision\(grad_reduce='reduce_scatter'\)"):
        compile_program(zero1, None, make_model())


def test_parallelize_refuses_a_model_in_another_dtype_than_the_plan_prices(world, plan) -> None:
    """A plan priced with bf16 weights and activations (a GPU plan's default) and a model whose parameters are
    fp32 (transformers' default) would train in fp32: twice the activations the plan counted, at fp32's speed.
    Refused before anything is built, naming both ways out; the model in the plan's dtype compiles."""
    bf16 = dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, compute="bf16", grads="bf16"))
    from autopar.codegen.compile import check_weights_dtype
    with pytest.raises(ConfigError, match=r"trainable parameters are float32: pass the model in bfloat16 "
                                          r"\(model.to\(torch.bfloat16\)\) or re-plan with "
                                          r"Precision\(compute='fp32', grads='fp32'\)"):
        program(bf16)
    check_weights_dtype(bf16, make_model().to(torch.bfloat16))
    frozen = make_model()
    for p in frozen.parameters():   # frozen weights train in no dtype: only the trainable ones count
        p.requires_grad_(False)
    check_weights_dtype(bf16, frozen)
    # an fp8 plan: its weights and activations in fp8_storage's dtype around the fp8 GEMMs (bf16 by default)
    fp8 = dataclasses.replace(plan, precision=autopar.Precision(compute="fp8"))
    with pytest.raises(ConfigError, match=r"float32: pass the model in bfloat16 \(model.to\(torch.bfloat16\)\) or "
                                          r"re-plan with Precision\(compute='fp8', fp8_storage='fp32'\)"):
        check_weights_dtype(fp8, make_model())
    check_weights_dtype(dataclasses.replace(plan, precision=autopar.Precision(compute="fp8", fp8_storage="fp32")),
                        make_model())
    # gradients priced in another dtype than the weights': a program accumulates and reduces them in the weights'
    main_grads = dataclasses.replace(plan, precision=autopar.Precision(compute="bf16", grads="fp32"))
    with pytest.raises(ConfigError, match=r"gradients accumulated and reduced in fp32 \(Precision\(grads='fp32'\)\), "
                                          r"but a program keeps them in its weights' dtype, bf16: re-plan with "
                                          r"Precision\(\.\.\., grads='bf16'\)"):
        check_weights_dtype(main_grads, make_model().to(torch.bfloat16))


def test_a_float64_plan_prices_and_trains_in_float64(world) -> None:
    """Precision(compute="fp64"): a float64 model priced at 8 bytes a weight, a gradient and an activation, and at
    the device's fp64 peak; parallelize trains it as one process's float64 AdamW does. A float64 model under an
    fp32 plan is refused naming the fp64 precision to re-plan with, and no stack's export takes a float64 plan."""
    wide = make_model().double()
    example = tuple(t.double() for t in batch())
    fp64 = autopar.Precision(compute="fp64", grads="fp64")
    plan = autopar.estimate(copy.deepcopy(wide), ONE, example, autopar.ParallelConfig(micro_batch_size=BATCH),
                            global_batch_size=BATCH, loss_fn=loss_fn, precision=fp64)
    fp32 = autopar.estimate(make_model(), ONE, batch(), autopar.ParallelConfig(micro_batch_size=BATCH),
                            global_batch_size=BATCH, loss_fn=loss_fn, precision=autopar.Precision(compute="fp32"))
    (mine,), (theirs,) = plan.stages, fp32.stages
    assert mine.memory.params == 2 * theirs.memory.params and mine.memory.grads == 2 * theirs.memory.grads
    assert mine.memory.activations == 2 * theirs.memory.activations
    assert plan.step_time > fp32.step_time   # the cpu preset's fp64 peak is half its fp32 one
    with pytest.raises(ConfigError, match=r"float64: pass the model in float32 \(model.to\(torch.float32\)\) or "
                                          r"re-plan with Precision\(compute='fp64', grads='fp64'\)"):
        program(fp32, copy.deepcopy(wide))
    prog = program(plan, copy.deepcopy(wide))
    ref = copy.deepcopy(wide)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        inputs = tuple(t.double() for t in batch(step))
        loss = prog.train_step(inputs)
        opt.zero_grad()
        want = loss_fn(ref(*inputs), inputs)
        want.backward()
        opt.step()
        assert loss.dtype == torch.float64 and torch.allclose(loss, want.detach(), rtol=1e-12, atol=0)
    got = prog.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-12, atol=1e-14)
    for stack in autopar.exports.STACKS:
        with pytest.raises(ConfigError, match=rf"trains in float64 .* which {stack} has no setting for"):
            plan.export(stack)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_is_torchs_on_one_rank(world, plan, norm_type) -> None:
    """One rank holds the whole model: the norm and the clipped gradients are torch.nn.utils.clip_grad_norm_'s
    (the multi-rank ways a rank holds gradients: tests/distributed/test_optimizers.py)."""
    prog = program(plan)
    assert prog.grad_norm is None
    prog.forward_backward(batch())
    grads = prog.full_grads()
    norm = prog.clip_grad_norm_(0.01, norm_type)
    model = make_model()
    loss_fn(model(*batch()), None).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    assert torch.allclose(norm, want, rtol=1e-6) and prog.grad_norm is norm and norm > 0.02
    clipped = prog.full_grads()
    for name, p in model.named_parameters():   # a parameter no op reads: zeros, where one process has None
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(clipped[name], want, rtol=1e-5, atol=1e-8)
        assert not torch.equal(clipped[name], grads[name]) or not grads[name].any()


def test_train_step_clips_and_forward_backward_forgets_the_norm(world, plan) -> None:
    prog = program(plan)
    prog.train_step(batch(), max_grad_norm=0.01)
    assert prog.grad_norm is not None and prog.grad_norm > 0.01
    prog.forward_backward(batch(1))
    assert prog.grad_norm is None


@pytest.mark.parametrize("max_norm, norm_type", [(0.0, 2.0), (-1.0, 2.0), (float("nan"), 2.0), (1.0, 0.0)])
def test_clip_grad_norm_refuses_a_bad_norm(world, plan, max_norm, norm_type) -> None:
    prog = program(plan)
    prog.forward_backward(batch())
    with pytest.raises(ConfigError, match="max_norm > 0 and norm_type > 0"):
        prog.clip_grad_norm_(max_norm, norm_type)


def _bf16():
    """The test model in bf16 with weights in [1, 2), and a bf16 mixed-precision plan of it (fp32 masters)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model = model.to(torch.bfloat16)
    example = tuple(t.to(torch.bfloat16) for t in batch())
    return model, autopar.estimate(copy.deepcopy(model), ONE, example, autopar.ParallelConfig(micro_batch_size=BATCH),
                                   global_batch_size=BATCH, loss_fn=loss_fn,
                                   precision=autopar.Precision(compute="bf16", grads="bf16"))


def _bf16_program(model, plan):
    return autopar.parallelize(copy.deepcopy(model), plan, lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=loss_fn)


def _bf16_batch(step):
    return tuple(t.to(torch.bfloat16) for t in batch(step))


def test_a_bf16_plan_steps_fp32_master_weights(world) -> None:
    """A bf16 mixed-precision plan (fp32 master weights, priced in the states' bytes) keeps fp32 masters beside
    the bf16 weights: AdamW's updates of about lr = 1e-3, below half a bf16 unit of weights in [1, 2) (0.0039),
    add up in the masters and move the weights after a few steps, as one process's mixed precision does;
    stepped as they are, the bf16 weights would never move. A learning-rate schedule on the program's
    optimizer sets the user's optimizer's rate."""
    from autopar.runtime.optim import MasterOptimizer, innermost, wrapped
    model, plan = _bf16()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    prog = _bf16_program(model, plan)
    masters = wrapped(prog.optimizer, MasterOptimizer)
    assert masters is not None and all(m.dtype == torch.float32 for m in masters.masters)
    schedule = torch.optim.lr_scheduler.LambdaLR(prog.optimizer, lambda step: 1.0)
    assert innermost(prog.optimizer).param_groups is prog.optimizer.param_groups
    ref = copy.deepcopy(model)   # one process: fp32 masters, AdamW on them, the bf16 weights copied from them
    fp32 = [p.detach().float().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.AdamW(fp32, lr=1e-3)
    for step in range(8):
        prog.train_step(_bf16_batch(step))
        schedule.step()
        ref.zero_grad()
        loss_fn(ref(*(t.to(torch.bfloat16) for t in batch(step))), None).backward()
        for m, p in zip(fp32, ref.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(fp32, ref.parameters()):
                p.copy_(m)
    got = prog.full_state_dict()
    moved = 0
    for name, p in ref.named_parameters():
        if name == "unused":
            continue
        moved += int((got[name] != start[name]).sum())
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=2 ** -6)   # a unit of bf16 in [1, 2)
    assert moved > 0.5 * sum(p.numel() for n, p in ref.named_parameters() if n != "unused")


def test_a_checkpoint_keeps_the_fp32_masters(world, tmp_path) -> None:
    """Saved and resumed after 4 steps, a bf16 mixed-precision program's next 4 steps equal the uninterrupted
    ones bit for bit: the checkpoint keeps each weight's fp32 master (``master.<fqn>``); widened from the bf16
    weights instead, the masters would lose what the weights round away, and the steps after would differ."""
    from autopar.runtime.optim import MasterOptimizer, wrapped
    model, plan = _bf16()
    first = _bf16_program(model, plan)
    for step in range(4):
        first.train_step(_bf16_batch(step))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    for step in range(4, 8):
        first.train_step(_bf16_batch(step))
    second = _bf16_program(model, plan)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    masters = wrapped(second.optimizer, MasterOptimizer).masters
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)   # fp32 values bf16 cannot hold
    for step in range(4, 8):
        second.train_step(_bf16_batch(step))
    want, got = first.full_state_dict(), second.full_state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    for a, b in zip(wrapped(first.optimizer, MasterOptimizer).masters, masters):
        assert torch.equal(a, b)


def test_one_process_load_of_a_mixed_precision_checkpoint_reads_the_masters(world, tmp_path) -> None:
    """``autopar.load_checkpoint`` into an fp32 copy of the model fills each weight from its saved fp32 master, the
    values the optimizer state was stepped with (the bf16 weights are their rounding); into a bf16 copy it reads
    the bf16 weights."""
    from autopar.runtime.optim import MasterOptimizer, wrapped
    model, plan = _bf16()
    prog = _bf16_program(model, plan)
    for step in range(4):
        prog.train_step(_bf16_batch(step))
    prog.save_checkpoint(str(tmp_path / "ckpt"))
    masters = wrapped(prog.optimizer, MasterOptimizer).copies(prog.stepped)
    assert masters and any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    weights = prog.full_state_dict()
    wide = copy.deepcopy(model).float()
    opt = torch.optim.AdamW(wide.parameters(), lr=1e-3)
    assert autopar.load_checkpoint(str(tmp_path / "ckpt"), wide, opt) == 4
    got = dict(wide.named_parameters())
    for name, master in masters.items():
        assert torch.equal(got[name], master), name
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values()) and len(opt.state) == len(masters)
    narrow = copy.deepcopy(model)
    autopar.load_checkpoint(str(tmp_path / "ckpt"), narrow)
    for name, p in narrow.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name]), name


def test_a_gradients_norm_that_is_not_finite_stops_the_step(world, plan, monkeypatch) -> None:
    """A gradient that overflows while the losses stay finite: clipping finds the norm inf, and the step stops
    before the optimizer runs, as for a loss that is not finite (the parameters unchanged)."""
    prog = program(plan)
    finish = prog._finish_grads

    def overflowed() -> None:
        finish()
        next(p for p in prog.parameters() if p.grad is not None).grad.fill_(float("inf"))
    monkeypatch.setattr(prog, "_finish_grads", overflowed)
    before = prog.full_state_dict()
    with pytest.raises(RuntimeFailure, match=r"step 0: the gradients' total norm is inf while every micro-batch's "
                                             r"loss is finite .* the parameters are unchanged"):
        prog.train_step(batch(), max_grad_norm=1.0)
    after = prog.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
