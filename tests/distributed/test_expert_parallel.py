"""Expert-parallel MoE (autopar.runtime.expert_parallel) on 2 and 4 gloo ranks vs one process.

Gloo ranks run every case once per world size: 2 ranks spawned here (they end with the silent-peer
check), the session's 4-rank world (worlds.py). Each case draws the full expert
weights and every rank's own tokens, routing and output cotangent ``g`` from one seed; each rank
runs ``expert_parallel_moe`` on its tokens and experts and backpropagates ``(out * g).sum()``.
The reference is one process with all ranks' tokens concatenated, a per-token loop over the k
choices with all E experts, and the loss ``sum over ranks of (out_r * g_r).sum()``: its gradient
w.r.t. each rank's tokens and weights is that rank's, and w.r.t. each expert the sum of every
rank's contributions, which is what the expert's owner must hold.

Tolerances: the EP path sums the same products in another order (k choices, GEMM row
blocking), so results agree to rounding: 1e-5 in float32 (values and gradients are O(1), a few
ulps of 6e-8 times the 24-wide reductions), 1e-10 in float64.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.errors import ConfigError
from autopar.runtime.expert_parallel import (activation_fn, dispatch_stats, expert_parallel_moe,
                                             local_expert_range, shard_experts)

sys.path.insert(0, os.path.dirname(__file__))
from harness import free_port  # noqa: E402

H, FF, T = 16, 24, 6
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    k: int
    activation: str = "silu"
    dtype: torch.dtype = torch.float32
    routing: str = "random"       # "random" | "one_rank" (all to the last rank's experts) | "skip_next" | "empty"
    timeout: float | None = 30.0  # None: the blocking collectives


def _cases() -> list[Case]:
    cases = [Case(f"E{e}-k{k}-{act}-{str(dt)[6:]}", e, k, act, dt, timeout=None if k == 1 else 30.0)
             for e in (4, 8) for k in (1, 2) for act in ("silu", "gelu") for dt in (torch.float32, torch.float64)]
    return cases + [
        Case("tanh-gelu", 8, 2, "gelu_pytorch_tanh"), Case("relu", 8, 2, "relu", torch.float64),
        Case("imbalanced", 8, 2, routing="one_rank"), Case("imbalanced-f64", 8, 1, dtype=torch.float64,
                                                            routing="one_rank"),
        Case("skip-next-rank", 8, 2, routing="skip_next"), Case("skip-next-rank-k1", 4, 1, routing="skip_next"),
        Case("rank1-no-tokens", 8, 2, routing="empty"),
    ]


CASES = _cases()


def _allowed(case: Case, world: int, rank: int) -> list[int]:
    """Experts rank ``rank``'s tokens may be routed to."""
    per = case.experts // world
    if case.routing == "one_rank":
        return list(range(case.experts - per, case.experts))
    if case.routing == "skip_next":
        banned = local_expert_range(case.experts, world, (rank + 1) % world)
        return [e for e in range(case.experts) if e not in banned]
    return list(range(case.experts))


def case_data(case: Case, world: int) -> dict:
    """Full expert weights and, per rank, tokens / distinct top-k ids / softmaxed weights / cotangent."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # stable across processes
    dt = case.dtype
    gate_up = (torch.randn(case.experts, 2 * FF, H, generator=gen, dtype=torch.float64) / H ** 0.5).to(dt)
    down = (torch.randn(case.experts, H, FF, generator=gen, dtype=torch.float64) / FF ** 0.5).to(dt)
    ranks = []
    for rank in range(world):
        n = 0 if case.routing == "empty" and rank == 1 else T
        allowed = torch.tensor(_allowed(case, world, rank))
        pick = torch.stack([torch.randperm(len(allowed), generator=gen)[:case.k] for _ in range(n)]) \
            if n else torch.zeros(0, case.k, dtype=torch.int64)
        ranks.append({"hidden": torch.randn(n, H, generator=gen, dtype=torch.float64).to(dt),
                      "index": allowed[pick].reshape(n, case.k),
                      "weights": torch.randn(n, case.k, generator=gen, dtype=torch.float64).softmax(-1).to(dt),
                      "g": torch.randn(n, H, generator=gen, dtype=torch.float64).to(dt)})
    return {"gate_up": gate_up, "down": down, "ranks": ranks}


def reference_moe(hidden, index, weights, gate_up, down, activation: str):
    """Per token, per choice: sum_j w_j * down_e(act(gate_e x) * up_e x), all E experts."""
    act = activation_fn(activation)
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros_like(hidden[t])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ hidden[t]).chunk(2)
            acc = acc + weights[t, j] * (down[e] @ (act(gate) * up))
        rows.append(acc)
    return torch.stack(rows) if rows else hidden.new_zeros(0, hidden.shape[1])


def reference(case: Case, world: int) -> dict:
    data = case_data(case, world)
    gate_up = data["gate_up"].clone().requires_grad_()
    down = data["down"].clone().requires_grad_()
    hidden = [r["hidden"].clone().requires_grad_() for r in data["ranks"]]
    weights = [r["weights"].clone().requires_grad_() for r in data["ranks"]]
    index = torch.cat([r["index"] for r in data["ranks"]])
    out = reference_moe(torch.cat(hidden), index, torch.cat(weights), gate_up, down, case.activation)
    g = torch.cat([r["g"] for r in data["ranks"]])
    (out * g).sum().backward()
    sizes = [r["hidden"].shape[0] for r in data["ranks"]]
    return {"out": out.detach().split(sizes), "hidden": [h.grad for h in hidden],
            "weights": [w.grad for w in weights], "gate_up": gate_up.grad, "down": down.grad}


def _run_case(case: Case, world: int, rank: int) -> dict:
    data = case_data(case, world)
    mine = data["ranks"][rank]
    gate_up = shard_experts(data["gate_up"], world, rank).clone().requires_grad_()
    down = torch.nn.Parameter(shard_experts(data["down"], world, rank).clone())
    hidden = mine["hidden"].clone().requires_grad_()
    weights = mine["weights"].clone().requires_grad_()
    out = expert_parallel_moe(hidden, mine["index"], weights, gate_up, down, num_experts=case.experts,
                              activation=case.activation, group=dist.group.WORLD, timeout=case.timeout)
    (out * mine["g"]).sum().backward()
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad, "gate_up": gate_up.grad,
            "down": down.grad}


def run_all(rank: int, world: int) -> dict:
    """Every case on this rank (the default process group up): case name -> outputs or {"error"}."""
    results: dict = {}
    start = time.perf_counter()
    for case in CASES:
        try:
            results[case.name] = _run_case(case, world, rank)
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent
            import traceback
            results[case.name] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    results["_seconds"] = time.perf_counter() - start
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The 2-rank spawn of its own: every case, then the silent peer (which ends both ranks)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(run_all(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    _silent_peer(rank, out_dir)


SILENT_TIMEOUT = 1.0


def _silent_peer(rank: int, out_dir: str) -> None:
    """Rank 1 goes silent; rank 0's call must raise RuntimeFailure within the timeout. Both leave with
    os._exit: rank 0's unfinished all-to-all would abort a normal teardown."""
    if rank == 1:
        time.sleep(SILENT_TIMEOUT + 0.5)
        os._exit(0)
    from autopar.errors import AutoparError
    case = Case("silent", 4, 1, timeout=SILENT_TIMEOUT)
    start = time.perf_counter()
    try:
        _run_case(case, 2, 0)
        outcome = "no error"
    except AutoparError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    torch.save({"outcome": outcome, "seconds": time.perf_counter() - start}, os.path.join(out_dir, "silent.pt"))
    os._exit(0)


_RESULTS: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    """Per rank: case name -> that rank's outputs and gradients (or {"error"}), computed once per world:
    on 2 ranks spawned here (the silent peer ends them), on the session's 4-rank world (worlds.py)."""
    if world not in _RESULTS:
        if world != 2:
            import worlds
            _RESULTS[world] = worlds.world(world).run("test_expert_parallel:run_all")
            return _RESULTS[world]
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(world, free_port(), out), nprocs=world, join=True,
                               start_method="spawn")
            _RESULTS[world] = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
            _RESULTS[world][0]["_silent"] = torch.load(os.path.join(out, "silent.pt"))
    return _RESULTS[world]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got is not None, f"{what}: no gradient"
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_single_process(case: Case, world: int) -> None:
    per_rank = results(world)
    ref = reference(case, world)
    for rank, res in enumerate(per_rank):
        got = res[case.name]
        assert "error" not in got, got.get("error")
        experts = local_expert_range(case.experts, world, rank)
        _close(got["out"], ref["out"][rank], case.dtype, f"rank {rank} output")
        _close(got["hidden"], ref["hidden"][rank], case.dtype, f"rank {rank} d hidden")
        _close(got["weights"], ref["weights"][rank], case.dtype, f"rank {rank} d top_k_weights")
        _close(got["gate_up"], ref["gate_up"][experts.start:experts.stop], case.dtype, f"rank {rank} d gate_up")
        _close(got["down"], ref["down"][experts.start:experts.stop], case.dtype, f"rank {rank} d down")


def test_silent_peer_raises_within_timeout() -> None:
    silent = results(2)[0]["_silent"]
    assert silent["outcome"].startswith("RuntimeFailure: rank 0: expert-parallel count all-to-all with rank 1"), \
        silent["outcome"]
    # about the timeout on an idle machine; 20 s of room for a loaded one, far below no deadline at all
    assert silent["seconds"] < SILENT_TIMEOUT + 20.0, f"took {silent['seconds']:.1f} s for a {SILENT_TIMEOUT} s timeout"


def test_imbalanced_case_is_imbalanced() -> None:
    """The routing cases really exercise what they claim (else the spawned checks prove less)."""
    for world in (2, 4):
        by_name = {c.name: c for c in CASES}
        data = case_data(by_name["imbalanced"], world)
        sent, imbalance = dispatch_stats(torch.cat([r["index"] for r in data["ranks"]]), 8, world)
        assert sent[:-1] == [0] * (world - 1) and imbalance == world
        data = case_data(by_name["skip-next-rank"], world)
        for rank, r in enumerate(data["ranks"]):
            assert dispatch_stats(r["index"], 8, world)[0][(rank + 1) % world] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ep1_without_group_matches_reference(dtype) -> None:
    case = Case("ep1", 8, 2, "gelu", dtype)
    data = case_data(case, 1)
    mine = data["ranks"][0]
    ref = reference(case, 1)
    gate_up, down = data["gate_up"].clone().requires_grad_(), data["down"].clone().requires_grad_()
    hidden, weights = mine["hidden"].clone().requires_grad_(), mine["weights"].clone().requires_grad_()
    out = expert_parallel_moe(hidden, mine["index"], weights, gate_up, down, num_experts=8, activation="gelu")
    (out * mine["g"]).sum().backward()
    _close(out.detach(), ref["out"][0], dtype, "output")
    for got, want, what in ((hidden.grad, ref["hidden"][0], "d hidden"), (weights.grad, ref["weights"][0], "d w"),
                            (gate_up.grad, ref["gate_up"], "d gate_up"), (down.grad, ref["down"], "d down")):
        _close(got, want, dtype, what)


def test_ep1_matches_hugging_face_mixtral_experts() -> None:
    """Same parameters and call as transformers v5's MixtralExperts, same numbers."""
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral",
                                   reason="transformers is not installed: cannot compare with MixtralExperts")
    from transformers import MixtralConfig
    config = MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=8, hidden_act="silu")
    experts = modeling.MixtralExperts(config).double()
    data = case_data(Case("hf", 8, 2, dtype=torch.float64), 1)
    with torch.no_grad():
        experts.gate_up_proj.copy_(data["gate_up"])
        experts.down_proj.copy_(data["down"])
    mine = data["ranks"][0]
    want = experts(mine["hidden"], mine["index"], mine["weights"])
    got = expert_parallel_moe(mine["hidden"], mine["index"], mine["weights"], experts.gate_up_proj,
                              experts.down_proj, num_experts=8, activation="silu", group=None)
    _close(got.detach(), want.detach(), torch.float64, "vs MixtralExperts")


def test_local_expert_range_and_shard() -> None:
    assert local_expert_range(8, 4, 0) == range(0, 2)
    assert local_expert_range(8, 4, 3) == range(6, 8)
    assert local_expert_range(8, 1, 0) == range(0, 8)
    param = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(shard_experts(param, 2, 1), param[4:])
    assert torch.equal(torch.cat([shard_experts(param, 4, r) for r in range(4)]), param)


def test_ep_must_divide_experts() -> None:
    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 8 experts.*choose an ep that divides"):
        local_expert_range(8, 3, 0)
    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 8 experts"):
        shard_experts(torch.zeros(8, 2), 3, 0)
    with pytest.raises(ConfigError, match=r"rank 2 is not a rank of an ep group of 2"):
        local_expert_range(8, 2, 2)
    with pytest.raises(ConfigError, match=r"ep must be a positive int"):
        dispatch_stats(torch.zeros(2, 1, dtype=torch.int64), 8, 0)


def test_dispatch_stats() -> None:
    index = torch.tensor([[0, 1], [2, 3], [0, 7]])
    assert dispatch_stats(index, 8, 2) == ([5, 1], 5 / 3)
    assert dispatch_stats(index, 8, 4) == ([3, 2, 0, 1], 2.0)
    assert dispatch_stats(torch.zeros(0, 2, dtype=torch.int64), 8, 2) == ([0, 0], 1.0)


def test_argument_errors() -> None:
    x, idx, w = torch.randn(3, H), torch.tensor([[0], [1], [2]]), torch.ones(3, 1)
    gu, dn = torch.randn(4, 2 * FF, H), torch.randn(4, H, FF)
    call = dict(num_experts=4, activation="silu")
    with pytest.raises(ConfigError, match=r"activation 'swiglu' is not supported.*'gelu'"):
        expert_parallel_moe(x, idx, w, gu, dn, num_experts=4, activation="swiglu")
    with pytest.raises(ConfigError, match=r"expert ids 0\.\.4, outside 0\.\.3"):
        expert_parallel_moe(x, torch.tensor([[0], [4], [2]]), w, gu, dn, **call)
    with pytest.raises(ConfigError, match=r"expert ids -1\.\.2"):
        dispatch_stats(torch.tensor([[-1], [2]]), 4, 2)
    with pytest.raises(ConfigError, match=r"gate_up_local must be \[E/ep=4, 2f, h=16\].*shard_experts"):
        expert_parallel_moe(x, idx, w, gu[:2], dn, **call)
    with pytest.raises(ConfigError, match=r"down_local must be \[E/ep=4, h=16, f=24\]"):
        expert_parallel_moe(x, idx, w, gu, dn.transpose(1, 2), **call)
    with pytest.raises(ConfigError, match=r"top_k_weights has shape \(3, 2\)"):
        expert_parallel_moe(x, idx, torch.ones(3, 2), gu, dn, **call)
    with pytest.raises(ConfigError, match=r"hidden must be \[tokens, hidden\]"):
        expert_parallel_moe(x[None], idx, w, gu, dn, **call)
    with pytest.raises(ConfigError, match=r"must share a dtype"):
        expert_parallel_moe(x.double(), idx, w, gu, dn, **call)
    with pytest.raises(ConfigError, match=r"timeout must be None or a positive number"):
        expert_parallel_moe(x, idx, w, gu, dn, timeout=0, **call)


def test_capacity_drops_what_the_capacity_dispatch_drops():
    """ep=1 with a capacity equals autopar.models.moe's Experts (static capacity dispatch) exactly."""
    from autopar.models.moe import Experts, MixtralConfig
    from autopar.runtime.expert_parallel import expert_parallel_moe
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=16, hidden=8, heads=2, kv_heads=2, layers=1, ffn_hidden=12, seq_len=4,
                        num_experts=4, top_k=2, capacity_factor=0.5)
    experts = Experts(cfg).double()
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 4, (10, 2))
    index[:, 1] = (index[:, 0] + 1) % 4
    weights = torch.rand(10, 2, dtype=torch.float64)
    expected = experts(hidden, index, weights)
    got = expert_parallel_moe(hidden, index, weights, experts.gate_up_proj, experts.down_proj, num_experts=4,
                              activation="silu", capacity=cfg.capacity(10))
    assert 4 * cfg.capacity(10) < 10 * 2                            # fewer slots than assignments: drops
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
