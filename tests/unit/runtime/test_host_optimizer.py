"""runtime/optim.py's MasterOptimizer: the step on fp32 masters of 16-bit weights, on the host (offload="optimizer")
or beside them on the device (a bf16 plan's master weights), the weights copied back."""

from __future__ import annotations

import torch

from autopar.runtime.optim import MasterOptimizer, innermost, wrapped


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def test_bf16_weights_step_on_fp32_masters():
    """Under mixed precision the masters are fp32: three steps equal fp32 AdamW on an fp32 copy, the weights
    its values rounded to bf16 (a bf16 step in place would drift from it)."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 32).bfloat16()), torch.nn.Parameter(torch.randn(32).bfloat16())]
    reference = [torch.nn.Parameter(w.detach().float()) for w in weights]
    host, ref = MasterOptimizer(weights, _adamw), _adamw(reference)
    assert all(m.dtype == torch.float32 and m.device.type == "cpu" for m in host.masters)
    for _ in range(3):
        grads = [torch.randn_like(r) for r in reference]
        for w, r, g in zip(weights, reference, grads):
            w.grad, r.grad = g.bfloat16(), g.bfloat16().float()   # the gradient as the device holds it
        host.step()
        ref.step()
        host.zero_grad()
    for w, m, r in zip(weights, host.masters, reference):
        assert torch.equal(m, r.detach()) and torch.equal(w.detach(), r.detach().bfloat16())
        assert w.grad is None and m.grad is None
    assert innermost(host) is host.inner and wrapped(host, MasterOptimizer) is host
    # a checkpoint names the host copies (what the inner optimizer's state is keyed by)
    named = host.stepped({"a": weights[0], "b": weights[1], "other": reference[0]})
    assert named["a"] is host.masters[0] and named["b"] is host.masters[1] and named["other"] is reference[0]
    assert set(host.inner.state) == set(host.masters)


def test_without_master_weights_the_copies_keep_the_weights_dtype_and_reload():
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    host = MasterOptimizer([w], _adamw, master_weights=False)
    assert host.masters[0].dtype == torch.bfloat16 and host.masters[0].data_ptr() != w.data_ptr()
    with torch.no_grad():
        w.fill_(3.0)   # as a checkpoint load fills the device tensors
    host.reload()
    assert torch.equal(host.masters[0], w.detach())


def test_on_the_device_only_16_bit_weights_get_masters():
    """Beside the weights (host False): a bf16 weight's master is an fp32 copy on its device, stepped as fp32
    AdamW; an fp32 weight is its own master, stepped in place (no copy, nothing copied back)."""
    torch.manual_seed(0)
    half, full = torch.nn.Parameter(torch.randn(16, 8).bfloat16()), torch.nn.Parameter(torch.randn(8))
    assert MasterOptimizer.needed([half, full], True) and not MasterOptimizer.needed([full], True)
    assert not MasterOptimizer.needed([half], False)
    reference = [torch.nn.Parameter(half.detach().float()), torch.nn.Parameter(full.detach().clone())]
    opt, ref = MasterOptimizer([half, full], _adamw, host=False), _adamw(reference)
    assert opt.masters[0].dtype == torch.float32 and opt.masters[0].data_ptr() != half.data_ptr()
    assert opt.masters[1].data_ptr() == full.data_ptr() and opt.aliased == [False, True]
    for _ in range(3):
        grads = [torch.randn_like(r) for r in reference]
        half.grad, full.grad = grads[0].bfloat16(), grads[1].clone()
        reference[0].grad, reference[1].grad = grads[0].bfloat16().float(), grads[1].clone()
        opt.step()
        ref.step()
    assert torch.equal(opt.masters[0], reference[0].detach()) and torch.equal(half.detach(), reference[0].detach().bfloat16())
    assert torch.equal(full.detach(), reference[1].detach())
