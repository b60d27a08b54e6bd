"""Context parallelism's per-graph analysis (codegen/context.py): no process group needed.

The distributed equivalence lives in tests/distributed/test_context_expert.py; these check the
decisions it rests on: where the sequence is, which ops run on local tokens, which gather.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
import autopar.codegen
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.capture import graph_of
from autopar.capture.export import run_export
from autopar.capture.opgraph import OpKind
from autopar.models import GPTConfig, build_gpt
from autopar.codegen.context import _view_layout, analyse
from autopar.runtime.context_state import FULL, PARTIAL, GatherTokens, Local, Mode, TakeTokens

SEQ = 8


def _analyse(model, inputs, cp=2):
    program = run_export(model, inputs, None)
    graph = graph_of(model, program)
    attention = frozenset(n.name for n in graph.nodes if n.kind is OpKind.ATTENTION)
    skipped = frozenset(n.name for n in program.graph.nodes if "assert" in str(n.target))
    return program, analyse(program, cp, attention, {}, skipped)


def _gpt(attention="sdpa", batch=2):
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=1, seq_len=SEQ, dropout=0.0,
                               attention=attention), batch_size=batch)


def test_views_follow_the_sequence_through_merges_and_splits():
    s = Local(1, SEQ)
    assert _view_layout((2, SEQ, 32), s, (2 * SEQ, 32)) == Local(0, SEQ, outer=2)      # [b*s, h] tokens
    assert _view_layout((2, SEQ, 96), s, (2, SEQ, 4, 3, 8)) == Local(1, SEQ)          # heads split off h
    assert _view_layout((2 * SEQ, 32), Local(0, SEQ, outer=2), (2, SEQ, 32)) == Local(1, SEQ)
    assert _view_layout((2, SEQ), s, (2, 2, SEQ // 2)) is None                        # the sequence itself cut


def test_gpt_runs_token_wise_with_ring_attention_and_a_partial_loss():
    model, inputs = _gpt()
    program, plan = _analyse(model, inputs)
    assert plan.inputs == {"input_ids": Local(1, SEQ), "labels": Local(1, SEQ)}
    modes = {name: step.mode for name, step in plan.steps.items()}
    attention = [n for n in modes if "scaled_dot_product_attention" in n]
    assert attention and all(modes[n] is Mode.RING for n in attention)
    assert modes["cross_entropy_loss"] is Mode.LOSS_MEAN and plan.states["cross_entropy_loss"] == PARTIAL
    # nothing is gathered: every op on the activations is token-wise
    assert not [n for n, step in plan.steps.items() for c in step.convert for x in c if isinstance(x, GatherTokens)]
    # the learned positions are computed whole and sliced where they meet the tokens
    sliced = [(n, v) for n, step in plan.steps.items() for v, c in zip(step.inputs, step.convert)
              if any(isinstance(x, TakeTokens) for x in c)]
    assert sliced and plan.local_shape("embedding", (2, SEQ, 32)) == (2, SEQ // 2, 32)


def test_hf_llama_gathers_labels_for_the_shift_and_keeps_a_padding_mask_whole():
    """Without an attention mask input the causal mask runs as is_causal (capture/causal.py); a
    padding mask (an input) is a real mask, and ring attention takes it whole."""
    import autopar.models.hf as hf
    torch.manual_seed(0)
    model, inputs = hf.build_hf_llama(layers=1, hidden=32, heads=4, vocab=64, seq_len=SEQ, dropout=0.0,
                                      batch_size=2)
    for padded in (False, True):
        if padded:
            inputs = dict(inputs, attention_mask=torch.ones_like(inputs["input_ids"]))
        program, plan = _analyse(model, inputs)
        gathered = {v for step in plan.steps.values() for v, c in zip(step.inputs, step.convert)
                    if any(isinstance(x, GatherTokens) for x in c)}
        # the pad-and-slice shift mixes positions: it gathers (and the padding mask, read whole)
        assert gathered == {"labels"} if not padded else "labels" in gathered
        attention = next(n for n in program.graph.nodes if "scaled_dot_product_attention" in str(n.target))
        assert plan.steps[attention.name].mode is Mode.RING
        if not padded:
            assert attention.kwargs.get("is_causal") and len(attention.args) == 3
        else:
            mask = attention.args[3]
            assert isinstance(mask, torch.fx.Node) and plan.states[mask.name] == FULL


class _InPlace(nn.Module):
    """Tokens added in place into a whole buffer: the write must not land on a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        acc = torch.zeros(x.shape)
        acc.add_(x)
        q = acc.view(x.shape[0], SEQ, 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).pow(2).mean()


def test_an_in_place_write_into_a_whole_value_runs_whole():
    program, plan = _analyse(_InPlace(), (torch.zeros(2, SEQ, dtype=torch.long),))
    add = next(n for n in plan.steps if n.startswith("add"))
    assert plan.steps[add].mode is Mode.FULL and plan.states[add] == FULL
    assert any(isinstance(x, GatherTokens) for c in plan.steps[add].convert for x in c)


def test_refusals_name_what_to_change():
    model, inputs = _gpt(attention="eager")
    with pytest.raises(ConfigError, match="fused attention"):
        _analyse(model, inputs)
    model, inputs = _gpt()
    with pytest.raises(ConfigError, match="multiple of 6"):
        _analyse(model, inputs, cp=3)


def test_emitted_script_states_context_and_expert_degrees(tmp_path):
    model, inputs = _gpt(batch=1)
    plan = autopar.estimate(model, Cluster.from_spec("1x4xcpu"), inputs, ParallelConfig(dp=2, cp=2),
                            global_batch_size=4)
    text = open(autopar.codegen.emit(plan, tmp_path, "mypkg.models:build")).read()
    assert "DP, CP, TP, PP, EP = 2, 2, 1, 1, 1" in text and "--nproc-per-node 4" in text
    assert "cp_rank" in text and "cp=2" in text
