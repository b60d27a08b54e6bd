"""The published-runs dataset (bench/data/published_runs.json) and its split (bench/data/split.json)
hold together: every source is in exactly one split, every row cites a source, its stored step time is
what its published figure implies by the formula the benches use, and every sweep is one model
measured at several configurations. Also the ranking helpers of bench/fidelity_split.py."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data():
    return json.loads((BENCH / "data" / "published_runs.json").read_text())


@pytest.fixture(scope="module")
def split():
    return json.loads((BENCH / "data" / "split.json").read_text())


def test_every_source_is_in_exactly_one_split(data, split):
    calibration, validation = set(split["calibration"]), set(split["validation"])
    assert not calibration & validation
    assert calibration | validation == set(data["sources"])
    assert {r["source"] for r in data["rows"]} == set(data["sources"])


def test_every_source_is_cited_and_tagged(data):
    for key, source in data["sources"].items():
        assert source["citation"] and source["url"].startswith("https://") and source["where"], key
        assert source["check"] in ("V", "D", "S"), key


def test_stored_step_times_follow_from_the_published_figures(data):
    published = _load("published")
    rows = {r.name: r for r in published.load_rows()}
    assert len(rows) == len(data["rows"])
    for d in data["rows"]:
        row = rows[d["id"]]
        implied = row.step_time_of(row.published, published.cluster_of(row))
        assert math.isclose(implied, d["step_time_s"], rel_tol=1e-3), (d["id"], implied, d["step_time_s"])


def test_a_sweep_is_one_model_at_several_configurations(data):
    sweeps: dict[str, list[dict]] = {}
    for d in data["rows"]:
        if d["sweep"]:
            sweeps.setdefault(d["sweep"], []).append(d)
    assert sweeps
    for name, rows in sweeps.items():
        assert len(rows) >= 3, name
        assert len({json.dumps(r["model"], sort_keys=True) for r in rows}) == 1, name
        assert len({r["source"] for r in rows}) == 1, name
        assert len({json.dumps(r["config"], sort_keys=True) + str(r["global_batch"]) for r in rows}) == len(rows), name


def test_ranks_share_ties_and_spearman_reads_order():
    _load("published")                  # fidelity_split imports it by name
    fidelity = _load("fidelity_split")
    assert list(fidelity.ranks([3.0, 1.0, 3.0, 2.0])) == [3.5, 1.0, 3.5, 2.0]
    assert fidelity.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert fidelity.spearman([1.0, 2.0, 3.0], [30.0, 20.0, 10.0]) == pytest.approx(-1.0)


def test_megatron_deepspeed_2022_falls_back_to_the_torch_softmax_where_its_check_did():
    """Megatron-DeepSpeed 541b967f's is_kernel_available, its arguments swapped (bench/published.py): the block is
    128 / min(next power of two of heads-per-rank, 32) warps of 2 rows; 64 heads at tp=8 fall back at micro-batches
    1, 2 and 6, as do 112 heads at tp=8 with micro-batch 4 (the chronicle's slow NHEADS=112 row); tp=4 and tp=2
    with 64 heads never. Only the BLOOM prequel's rows take the rule, and their precision says what ran."""
    published = _load("published")
    rule = published.megatron_deepspeed_2022_fused_softmax
    bloom = published.Model(family="gpt", hidden=14336, heads=64, layers=72, seq=2048, vocab=250880)
    assert [rule(bloom, 8, mb) for mb in (1, 2, 4, 6, 8)] == [False, False, True, False, True]
    assert all(rule(bloom, tp, mb) for tp in (2, 4) for mb in (1, 2, 4))
    heads112 = published.Model(family="gpt", hidden=14336, heads=112, layers=72, seq=2048, vocab=250880)
    assert not rule(heads112, 8, 4) and rule(heads112, 4, 2)
    long = published.Model(family="gpt", hidden=14336, heads=64, layers=72, seq=4096, vocab=250880)
    assert not rule(long, 4, 2)                  # the 2022 kernel took keys up to 2048
    rows = published.load_rows()
    prequel = [r for r in rows if r.source == "bloom-tr11-prequel"]
    assert prequel and all(r.precision.fused_softmax == rule(r.model, r.fixed["tp"], r.fixed["micro_batch_size"])
                           for r in prequel)
    assert any(not r.precision.fused_softmax for r in prequel)
    assert all(r.precision.fused_softmax for r in rows if r.source != "bloom-tr11-prequel")


def test_the_bloom_prequels_fp16_zero1_rows_all_reduce_their_gradients():
    """DeepSpeed 0.4.4-0.12's stage 1 all-reduces the gradients (its engine turns contiguous_gradients off):
    the BLOOM prequel's fp16 ZeRO-1 rows say so; its bf16 rows (another optimizer) and every other source do not."""
    rows = _load("published").load_rows()
    fp16 = [r for r in rows if r.source == "bloom-tr11-prequel" and r.precision.compute == "fp16"]
    assert fp16 and all(r.precision.grad_reduce == "all_reduce" and r.fixed["zero"] == 1 for r in fp16)
    others = [r for r in rows if r not in fp16]
    assert others and all(r.precision.grad_reduce == "reduce_scatter" for r in others)


def test_a_sweeps_inconsistent_pair_and_the_ranking_it_allows():
    """Two rows of one configuration at two global batches fix a 1F1B step's slot time and tail; a pair whose tail
    is most of its step is flagged (either member may be the wrong one), a consistent pair is not, and the ceiling
    is the Spearman of a model exact on every row but the flagged member, priced as its sibling implies."""
    published = _load("published")
    fidelity = _load("fidelity_split")
    model = published.Model(family="gpt", hidden=1024, heads=16, layers=24, seq=2048, vocab=51200)

    def priced(pp, dp, batch, seconds):
        fixed = dict(tp=8, pp=pp, dp=dp, cp=1, micro_batch_size=1, zero=1, recompute="full",
                     sequence_parallel=False, schedule="1f1b")
        row = published.Row(name=f"pp{pp} dp{dp} gbs{batch}", source="s", model=model, cluster="8x8xA100-80GB",
                            global_batch=batch, fixed=fixed, metric="seconds", published=seconds)
        return fidelity.Priced(row, "validation", seconds, seconds, "estimate", "")

    # pp 4, dp 8: 16 + 3 and 32 + 3 slots. A pair 1 s a slot with a 2 s tail is a pipeline; one that takes
    # nearly as long at half the batch is not (its tail: 36.4 - 35 x 0.0625 = 34.2 s)
    good = [priced(4, 8, 128, 21.0), priced(4, 8, 256, 37.0)]
    assert fidelity.inconsistent_pairs(good) == []
    bad = [priced(4, 8, 128, 35.4), priced(4, 8, 256, 36.4)]
    (lo, hi, tail), = fidelity.inconsistent_pairs(bad)
    assert (lo, hi) == (bad[0], bad[1]) and tail == pytest.approx(36.4 - 35 / 16)
    assert fidelity.slots(bad[0].row) == 19 and fidelity.slots(bad[1].row) == 35
    # a sweep ranked by that pair and a third configuration: measured per sequence, gbs128 is slowest; a model exact
    # but for it (priced 36.4 x 19 / 35 = 19.76 s, 0.154 s a sequence) ranks it between the others
    sweep = bad + [priced(2, 16, 256, 40.0)]
    ceiling, noisy, pairs = fidelity.ranking_ceiling(sweep)
    assert len(pairs) == 1 and ceiling == pytest.approx(0.5)
    assert len(noisy) == len(fidelity.CEILING_ERRORS) and all(-1 <= v <= 1 for v in noisy)
    assert fidelity.ranking_ceiling(good + [priced(2, 16, 256, 40.0)])[:1] == (pytest.approx(1.0),)
