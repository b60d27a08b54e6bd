"""A softmax cross entropy priced as the passes each program makes over its scores
(cost_model/compute.py's ``loss_bytes``), and kept for backward as each program keeps it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import Cluster
from autopar.capture import capture
from autopar.capture.fusion import for_kernels
from autopar.capture.opgraph import OpKind
from autopar.cost_model.compute import ComputeModel, loss_bytes
from autopar.models import GPTConfig, build_gpt

H100 = Cluster.from_spec("1x8xH100-SXM").device
VOCAB, SEQ = 1000, 64


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(vocab_size=VOCAB, hidden=64, heads=4, layers=1, seq_len=SEQ)
    model, inputs = build_gpt(cfg, batch_size=2, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


class FloatLoss(nn.Module):
    """A head whose loss casts its scores to fp32 first, as Hugging Face's causal-LM loss does."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x).float(), labels)


def loss_of(graph):
    (node,) = [n for n in graph.nodes if n.kind is OpKind.LOSS]
    return node


def test_each_program_makes_its_own_passes_over_the_scores(gpt):
    node = loss_of(gpt)
    scores = 2 * SEQ * VOCAB
    assert loss_bytes(gpt, node, "eager", "bf16") == (4 * scores, 8 * scores)       # 2d, 4d
    assert loss_bytes(gpt, node, "compiled", "bf16") == (4 * scores, 4 * scores)    # 2d, 2d
    assert loss_bytes(gpt, node, "fused", "bf16") == (38 * scores, 14 * scores)     # fp32 copy: c = 6
    assert loss_bytes(gpt, node, "fused", "fp32") == (32 * scores, 8 * scores)      # no copy
    assert loss_bytes(gpt, node, "eager", "fp32") == (8 * scores, 16 * scores)
    others = [n for n in gpt.nodes if n.kind is not OpKind.LOSS]
    assert all(loss_bytes(gpt, n, "fused", "bf16") is None for n in others)


def test_the_time_is_the_passes_at_the_devices_bandwidth_and_splits_with_the_vocabulary(gpt):
    node = loss_of(gpt)
    fwd, bwd = loss_bytes(gpt, node, "fused", "bf16")
    model = ComputeModel(gpt, H100, "bf16", kernels="fused")
    bandwidth = H100.memory_bandwidth * H100.memory_efficiency
    t = model.op_time(node, 1.0, 1, "")
    assert t.fwd == pytest.approx(fwd / bandwidth + H100.kernel_overhead)
    assert t.bwd == pytest.approx(bwd / bandwidth + 2 * H100.kernel_overhead)
    half = model.op_time(node, 2.0, 4, "")   # a micro-batch of 4 sequences, the vocabulary over 4 ranks
    assert half.fwd == pytest.approx(fwd / 2 / bandwidth + H100.kernel_overhead)
    eager = ComputeModel(gpt, H100, "bf16").op_time(node, 1.0, 1, "")
    launches = 3 * H100.kernel_overhead
    assert (t.fwd + t.bwd - launches) / (eager.fwd + eager.bwd - launches) == pytest.approx(52 / 12)


def test_scores_cast_to_fp32_on_purpose_are_priced_at_fp32():
    model = FloatLoss().to(torch.bfloat16)
    graph = capture(model, (torch.randn(2, 32, dtype=torch.bfloat16), torch.randint(0, VOCAB, (2,))))
    node = loss_of(graph)
    # a bf16 program: the cast is its own op, the loss reads fp32 scores (Megatron's .float() copies nothing)
    assert loss_bytes(graph, node, "fused", "bf16") == (32 * 2 * VOCAB, 8 * 2 * VOCAB)
    assert loss_bytes(graph, node, "eager", "bf16") == (8 * 2 * VOCAB, 16 * 2 * VOCAB)


def test_megatron_keeps_fp32_probabilities_where_autograd_keeps_the_scores_dtype(gpt):
    def kept(kernels):
        node = loss_of(for_kernels(gpt, kernels))
        return {st.root.split(":")[1]: st for st in node.saved if ":" in st.root}["log_probs"]

    assert kept("eager").dtype == "bfloat16" and kept("compiled").dtype == "bfloat16"
    fused = kept("fused")
    assert fused.dtype == "float32" and fused.numel == kept("eager").numel == 2 * SEQ * VOCAB
