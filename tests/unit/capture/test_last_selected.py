"""capture/last_selected.py: rows picked by a boolean mask, viewed per sample, last one taken (the
end-of-sequence pooling of encoder-decoder sequence classifiers) become a static gather, equal to
the original; any other use of a mask selection stays (and capture refuses it by name)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

from autopar.capture.export import run_export
from autopar.errors import CaptureError

EOS = 2


class Pool(nn.Module):
    """A toy classifier pooling, as Bart's does, at each sample's last ``EOS`` token; ``other`` uses
    the selection another way (a sum over the picked rows)."""

    def __init__(self, other: bool = False) -> None:
        super().__init__()
        self.other = other
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mask = ids.eq(EOS)
        torch._check(torch.unique_consecutive(mask.sum(1)).numel() == 1, lambda: "as many <eos> per sample")
        picked = h[mask, :]
        if self.other:
            return picked.sum()
        return self.head(picked.view(h.size(0), -1, h.size(-1))[:, -1, :]).pow(2).mean()


def _ids() -> torch.Tensor:
    ids = torch.randint(3, 16, (4, 10), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = EOS
    ids[0, 3] = ids[1, 5] = ids[2, 0] = ids[3, 8] = EOS   # two per sample: the last one is pooled
    return ids


def test_mask_pooling_becomes_a_static_gather_equal_to_the_module():
    torch.manual_seed(0)
    model, ids = Pool(), _ids()
    program = run_export(model, (ids,), None, train_mode=False)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "aten.gather.default" in targets
    assert not {"aten.index.Tensor", "aten.unique_consecutive.default", "aten._assert_scalar.default"} & targets
    for n in program.graph.nodes:   # every shape static
        val = n.meta.get("val")
        assert not isinstance(val, torch.Tensor) or all(isinstance(d, int) for d in val.shape), n
    torch.testing.assert_close(program.module()(ids), model(ids), rtol=0, atol=0)
    other = _ids()
    other[:, 6] = EOS   # another input with three per sample: the program takes the last, as the model
    torch.testing.assert_close(program.module()(other), model(other), rtol=0, atol=0)


def test_gradients_equal_the_modules():
    torch.manual_seed(0)
    model, ids = Pool(), _ids()
    program = run_export(copy.deepcopy(model), (ids,), None, train_mode=False).module()
    program(ids).backward()
    mine = {k.split(".", 1)[-1]: p.grad.clone() for k, p in program.named_parameters()}   # under the loss wrapper
    model(ids).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(mine[k], p.grad, rtol=1e-6, atol=1e-7)


def test_another_use_of_a_selection_stays_and_is_refused_by_name():
    from autopar.capture import capture
    with pytest.raises(CaptureError, match="makes a tensor of shape .* depends on the values"):
        capture(Pool(other=True), (_ids(),))


@pytest.mark.parametrize("name", ["BartForSequenceClassification", "T5ForSequenceClassification"])
def test_hf_encoder_decoder_classifiers_capture_and_compute_the_same_loss(name):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    from autopar.capture import capture
    from autopar.models import shrink
    arch = next(a for a in shrink.architectures() if a.name == name)
    model = shrink.build(arch, dropout=0.0)
    batch = shrink.example(arch, model, 2)
    program = run_export(model, batch, None, train_mode=False)
    torch.testing.assert_close(program.module()(**batch), model(**batch).loss, rtol=1e-6, atol=1e-6)
    meta = shrink.build(arch, "meta", dropout=0.0)
    assert capture(meta, shrink.example(arch, meta, 1, device="meta")).layers
