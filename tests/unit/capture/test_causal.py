"""capture/causal.py: an explicit mask that is the causal triangle, built from shapes alone, runs as
``is_causal=True`` (as the model's own eager step runs it); any other mask stays."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.export import run_export

SEQ = 8


class Attention(nn.Module):
    """One attention call whose mask ``kind`` builds: the causal triangle (bool, additive float with
    the dtype's lowest value or -inf), a band, a buffer's, or the caller's."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(16, 16)
        self.register_buffer("tri", torch.ones(SEQ, SEQ, dtype=torch.bool).tril())

    def mask(self, x: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
        s = x.shape[-2]
        rows = torch.arange(s, device=x.device)
        keep = rows[:, None] >= rows[None, :]
        if self.kind == "bool":
            return keep[None, None].expand(x.shape[0], 1, s, s)
        if self.kind in ("float_min", "float_inf"):
            low = torch.finfo(x.dtype).min if self.kind == "float_min" else float("-inf")
            return torch.zeros(s, s, dtype=x.dtype, device=x.device).masked_fill(~keep, low)
        if self.kind == "band":
            return keep & (rows[:, None] - rows[None, :] < 3)
        if self.kind == "buffer":
            return self.tri
        return given[:, None, None, :].bool() & keep

    def forward(self, x: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], SEQ, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask(x, given)).pow(2).mean()


def _attention(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


@pytest.mark.parametrize("kind,causal", [("bool", True), ("float_min", True), ("float_inf", True), ("band", False),
                                         ("buffer", False), ("input", False)])
def test_causal_masks_run_as_is_causal_and_others_stay(kind, causal):
    torch.manual_seed(0)
    model = Attention(kind)
    x = torch.randn(2, SEQ, 16)
    inputs = (x, torch.ones(2, SEQ)) if kind == "input" else (x,)
    program = run_export(model, inputs, None, train_mode=False)
    (node,) = _attention(program)
    assert bool(node.kwargs.get("is_causal")) is causal
    assert (len(node.args) == 3 and "attn_mask" not in node.kwargs) is causal
    if causal:   # the mask's construction is gone with it
        assert not [n for n in program.graph.nodes if n.op == "call_function" and "arange" in str(n.target)]
    torch.testing.assert_close(program.module()(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


def test_hf_llama_runs_causal_attention_with_no_mask_ops():
    import autopar.models.hf as hf
    model, inputs = hf.build_hf_llama(layers=2, seq_len=SEQ, dropout=0.0)
    program = run_export(model, inputs, None, train_mode=False)
    calls = _attention(program)
    assert len(calls) == 2 and all(n.kwargs.get("is_causal") and len(n.args) == 3 for n in calls)
    torch.testing.assert_close(program.module()(**inputs), model(**inputs).loss, rtol=1e-5, atol=1e-6)


def test_the_decision_does_not_depend_on_the_batch(monkeypatch):
    """A plan made from batch-1 inputs and the program exported at its micro-batch see the same
    graph: the size bound is one (query x key) plane, not the whole batched mask."""
    import autopar.capture.causal as causal
    monkeypatch.setattr(causal, "_MAX_PLANE", SEQ * SEQ)
    for batch in (1, 64):
        program = run_export(Attention("bool"), (torch.randn(batch, SEQ, 16),), None, train_mode=False)
        (node,) = _attention(program)
        assert node.kwargs.get("is_causal") and len(node.args) == 3, batch
