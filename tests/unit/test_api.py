"""The public entry points: names, estimate() wiring, defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import autopar
from autopar import Cluster, ParallelConfig, Plan, Precision
from autopar.capture import capture
from autopar.models import build_hf_gpt2, build_mlp


def test_public_names() -> None:
    for name in ("estimate", "load_plan", "Cluster", "Device", "Link", "ParallelConfig", "Plan", "AutoparError",
                 "ConfigError", "CaptureError", "InfeasiblePlanError", "PlanFormatError", "PlanMismatchError",
                 "RuntimeFailure"):
        assert name in autopar.__all__ and hasattr(autopar, name)
    assert issubclass(autopar.ConfigError, ValueError)
    for name in ("ConfigError", "CaptureError", "InfeasiblePlanError", "PlanFormatError", "PlanMismatchError",
                 "RuntimeFailure"):
        assert issubclass(getattr(autopar, name), autopar.AutoparError)


def test_public_names_load_on_first_use() -> None:
    """``import autopar`` imports no torch (PEP 562 facade); every public name, ``from autopar import X``,
    ``dir(autopar)`` and the subpackages still work, and ``autopar.plan`` / ``autopar.sweep`` stay the
    functions after their same-named modules are imported."""
    code = textwrap.dedent("""\
        import sys
        import autopar
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
        assert set(autopar.__all__) <= set(dir(autopar)), set(autopar.__all__) - set(dir(autopar))
        import autopar.plan, autopar.sweep
        from autopar.plan import Plan
        from autopar import plan, sweep, Plan as Same, ConfigError
        import autopar.api, autopar.sweep as sweep_module
        assert plan is autopar.plan is autopar.api.plan and Same is Plan, autopar.plan
        assert callable(sweep) and sweep is autopar.sweep and not isinstance(autopar.sweep, type(sys))
        assert all(getattr(autopar, name) is not None for name in autopar.__all__)
        assert callable(autopar.codegen.emit) and callable(autopar.models.build)
        assert not hasattr(autopar, "no_such_name")
        print("ok")
        """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
    assert proc.stdout.strip() == "ok", proc.stderr


def test_estimate_matches_capture_then_cost_model(plan_gpt) -> None:
    model, inputs, graph = plan_gpt
    cluster = Cluster.from_spec("1x8xA100-80GB")
    cfg = ParallelConfig(dp=4, tp=2)
    plan = autopar.estimate(model, cluster, inputs, cfg, global_batch_size=32)
    assert isinstance(plan, Plan)
    assert plan.config == cfg and plan.cluster == cluster and plan.global_batch_size == 32
    assert plan.fingerprint == graph.fingerprint and plan.model_name == "GPT"
    assert plan.precision == Precision()  # bf16 mixed precision with Adam on GPUs
    assert plan.micro_batches == 32 // 4
    assert plan.fits and 0 < plan.peak_memory < cluster.device.memory


def test_estimate_defaults_to_fp32_on_cpu() -> None:
    model, inputs = build_mlp(device="meta")
    plan = autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs, ParallelConfig(dp=2), global_batch_size=8,
                            loss_fn=lambda out, inp: out.float().pow(2).mean())
    assert plan.precision.compute == "fp32" and plan.precision.grads == "fp32"
    # fp32 weights and gradients, Adam's two fp32 states and no extra master copy: 16 bytes a parameter.
    graph_params = sum(p.numel() for p in model.parameters())
    assert plan.stages[0].memory.params + plan.stages[0].memory.grads + plan.stages[0].memory.optimizer \
        == 16 * graph_params


def test_loss_fn_is_traced() -> None:
    model, inputs = build_mlp(device="meta")
    plain = capture(model, inputs)  # stand-in loss: the mean of the output
    extra = torch.nn.Parameter(torch.empty(16, 16, device="meta"))
    costly = capture(model, inputs, lambda out, inp: (out @ extra.detach()).pow(2).mean())
    assert costly.flops_fwd > plain.flops_fwd  # the loss function's matmul is part of the graph
    assert costly.param_numel == plain.param_numel  # and its tensors are not model parameters


def test_estimate_hf_model_on_meta() -> None:
    model, inputs = build_hf_gpt2(layers=2, device="meta")
    plan = autopar.estimate(model, Cluster.from_spec("1x8xH100-SXM"), inputs, ParallelConfig(dp=2, pp=2, tp=2),
                            global_batch_size=16)
    assert plan.model_name == "GPT2LMHeadModel"
    assert [len([n for n in s.layers if n.startswith("transformer.h.")]) for s in plan.stages] == [1, 1]
