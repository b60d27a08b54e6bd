"""Expert parallelism (EP): the E experts of an MoE layer split over the ``ep`` ranks of a group.

Interface and maths of one MoE experts call, as Hugging Face transformers v5's
``MixtralExperts`` / ``Qwen2MoeExperts`` compute it on ``T`` tokens ``x_t`` (rows of
``hidden`` [T, h]) routed to ``k`` experts each (``top_k_index`` [T, k], weights ``w`` [T, k]),
with ``gate_up_proj`` [E, 2f, h] (the f gate rows, then the f up rows) and ``down_proj``
[E, h, f]::

    out_t = sum_j  w_tj * D_e (act(G_e x_t) * (U_e x_t)),    e = top_k_index[t, j]

Placement. Rank ``q`` of the group holds experts ``[q*E/ep, (q+1)*E/ep)``
(:func:`local_expert_range`, :func:`shard_experts`); ``ep`` must divide E.

Forward on each rank (:func:`expert_parallel_moe`), every rank with its own T tokens:

1. Dispatch permutation (:func:`_route`). Flatten the T*k assignments (row ``a = t*k + j``)
   and sort them stably by expert id: ``order``; ``token[i] = order[i] // k``. Sorted by
   expert means sorted by destination rank ``e // (E/ep)``. ``counts[e]`` = assignments to e.
2. Count exchange: an all-to-all of ``counts`` viewed [ep, E/ep] gives ``recv[s, i]``, the rows
   rank s sends to local expert i (E int64 per rank; no autograd).
3. Dispatch all-to-all: ``x[token]`` [T*k, h], with input splits ``counts`` summed per
   destination and output splits ``recv`` summed per source (variable sizes: nothing dropped).
4. Local experts (:func:`_local_experts`): the received rows come ordered (source, local
   expert); a stable sort by local expert groups them, each local expert runs its two GEMMs
   on its slice, and the inverse permutation puts the results back in received order.
5. Combine all-to-all: the reverse exchange (the splits swapped) returns ``y`` [T*k, h] to the
   ranks that own the tokens, in ``order``; ``out = index_add(token, w[order] * y)``.

Backward: autograd runs the two all-to-alls in reverse (:class:`_AllToAll`), the combine's
backward sends ``dy`` to the experts' ranks, the dispatch's backward sends ``dx`` back, so
gradients reach ``hidden``, ``top_k_weights`` (on the owning rank, with no communication) and
the local expert weights. The expert weights of rank q collect the contributions of every
rank's tokens routed to them.

Communication per rank per call, at balance: each all-to-all moves T*k*h elements out and
T*k*h in (a fraction (ep-1)/ep of them leave the rank), so forward moves 2*T*k*h elements
each way and backward 2*T*k*h more. Routing is rarely balanced: with ``N_q`` the rows routed
to rank q's experts (summed over the group), the busiest rank receives and computes
``I = max_q N_q / mean_q N_q`` (the imbalance factor, :func:`dispatch_stats`) times the
balanced share, and every rank waits for it.

Expert weights and data parallelism (the runtime follows this). Let the ``dp`` data-parallel
ranks each hold a batch shard with local loss ``L_r`` and global loss ``L = (1/dp) sum_r L_r``,
and let each ep group be ``ep`` of those ranks (``ep`` divides ``dp``, ``dp/ep`` groups). Each
rank backpropagates its own ``L_r``; then on a rank p holding expert e,
``grad_p(W_e) = sum_{r in ep_group(p)} dL_r/dW_e``: it already sums the ep group's tokens.
Expert e is held by the ``dp/ep`` ranks of the same ep-rank, one per ep group (its
expert-data-parallel group), and ``dL/dW_e = (1/dp) * sum_{p in edp(e)} grad_p(W_e)``. So:

- expert weights are all-reduced (sum) over their ``dp/ep`` replicas only, never over the ep
  group (whose ranks hold other experts); with ``ep == dp`` there is no expert all-reduce;
- the sum is divided by ``dp``, the same 1/dp the dense weights' data-parallel average
  applies, not by the ``dp/ep`` replicas it was summed over (that would scale by ``ep``);
- any other scaling of the seed (1/micro-batches) applies to both alike, as autograd carries it.

Collectives: with ``timeout`` (seconds) every all-to-all is asynchronous and waited on with
:func:`.failures.wait_or_fail`; with ``timeout=None`` they are blocking and rely on the
process group's own timeout. ``torch.distributed.nn.functional.all_to_all_single`` does the
same autograd on gloo, but it is deprecated (FutureWarning) and blocking with no deadline.
The local experts run as a loop of per-expert GEMMs: ``torch.nn.functional.grouped_mm``
needs bf16 on CUDA (it fails on CPU for fp32 and float64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import ConfigError
from .failures import start, wait_or_fail

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "elu": F.elu,
    "leaky_relu": F.leaky_relu,
    "softplus": F.softplus,
    "relu6": F.relu6,
    "hardswish": F.hardswish,
}
"""Hugging Face ``hidden_act`` names (ACT2FN) -> the torch function they compute: every name capture
gives a MoE region (capture/moe.py, at the functions' default parameters)."""


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch function of a Hugging Face activation name."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation {name!r} is not supported by expert parallelism; use one of "
                          f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _check_degree(num_experts: int, ep: int) -> None:
    if not (isinstance(num_experts, int) and num_experts >= 1):
        raise ConfigError(f"num_experts must be a positive int, got {num_experts!r}")
    if not (isinstance(ep, int) and ep >= 1):
        raise ConfigError(f"ep must be a positive int, got {ep!r}")
    if num_experts % ep:
        raise ConfigError(f"ep={ep} does not divide the {num_experts} experts; choose an ep that divides "
                          f"the expert count {num_experts}")


def local_expert_range(num_experts: int, ep: int, rank: int) -> range:
    """Global ids of the experts that rank ``rank`` (0 <= rank < ep) of the ep group holds."""
    _check_degree(num_experts, ep)
    if not (isinstance(rank, int) and 0 <= rank < ep):
        raise ConfigError(f"rank {rank!r} is not a rank of an ep group of {ep}; use 0..{ep - 1}")
    per = num_experts // ep
    return range(rank * per, (rank + 1) * per)


def shard_experts(param: torch.Tensor, ep: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s experts of an [E, ...] expert parameter: a view of E/ep rows (clone to own it)."""
    if param.dim() < 1:
        raise ConfigError(f"an expert parameter has the experts on dim 0; got a {param.dim()}-d tensor")
    r = local_expert_range(int(param.shape[0]), ep, rank)
    return param[r.start:r.stop]


def dispatch_stats(top_k_index: torch.Tensor, num_experts: int, ep: int) -> tuple[list[int], float]:
    """(rows this routing sends to each ep rank, imbalance = max / mean of those; 1.0 when empty)."""
    _check_degree(num_experts, ep)
    flat = top_k_index.reshape(-1)
    _check_ids(flat, num_experts)
    per_rank = torch.bincount(flat, minlength=num_experts).view(ep, -1).sum(1).tolist()
    total = sum(per_rank)
    return per_rank, (max(per_rank) * ep / total if total else 1.0)


def _check_ids(flat: torch.Tensor, num_experts: int) -> None:
    if flat.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"top_k_index must hold integer expert ids (int64 or int32), got dtype {flat.dtype}")
    if flat.numel():
        lo, hi = torch.stack([flat.min(), flat.max()]).tolist()
        if lo < 0 or hi >= num_experts:
            raise ConfigError(f"top_k_index holds expert ids {lo}..{hi}, outside 0..{num_experts - 1}; "
                              "route every assignment to a real expert (or pass the right num_experts)")


def _check_inputs(hidden, top_k_index, top_k_weights, gate_up, down, num_experts: int, ep: int) -> None:
    if hidden.dim() != 2:
        raise ConfigError(f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}; flatten the "
                          "batch and sequence dims first")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
        raise ConfigError(f"top_k_index must be [{hidden.shape[0]}, k] for {hidden.shape[0]} tokens, got "
                          f"{tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ConfigError(f"top_k_weights has shape {tuple(top_k_weights.shape)}; it must match top_k_index's "
                          f"{tuple(top_k_index.shape)}")
    per, h = num_experts // ep, hidden.shape[1]
    if gate_up.dim() != 3 or gate_up.shape[0] != per or gate_up.shape[2] != h or gate_up.shape[1] % 2:
        raise ConfigError(f"gate_up_local must be [E/ep={per}, 2f, h={h}], got {tuple(gate_up.shape)}; pass "
                          f"shard_experts(gate_up_proj, ep={ep}, rank)")
    f = gate_up.shape[1] // 2
    if tuple(down.shape) != (per, h, f):
        raise ConfigError(f"down_local must be [E/ep={per}, h={h}, f={f}], got {tuple(down.shape)}; pass "
                          f"shard_experts(down_proj, ep={ep}, rank)")
    if not (hidden.dtype == gate_up.dtype == down.dtype):
        raise ConfigError(f"hidden ({hidden.dtype}), gate_up_local ({gate_up.dtype}) and down_local "
                          f"({down.dtype}) must share a dtype; cast the experts or the activations")


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any,
              timeout: float | None, what: str) -> torch.Tensor:
    """All-to-all of the rows of ``x``: ``in_splits[d]`` rows go to rank d, ``out_splits[s]`` come from s."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    x = x.contiguous()
    if timeout is None:
        dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    else:
        work = start(dist.all_to_all_single, out, x, list(out_splits), list(in_splits), group=group, async_op=True)
        wait_or_fail(work, timeout, what, group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable :func:`_exchange`; its backward is the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timeout, what):  # type: ignore[override]
        ctx.meta = (out_splits, in_splits, group, timeout, what)
        return _exchange(x, out_splits, in_splits, group, timeout, what)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits, group, timeout, what = ctx.meta
        back = _AllToAll.apply(grad, in_splits, out_splits, group, timeout, f"backward of {what}")
        return back, None, None, None, None, None


@dataclass(frozen=True)
class _Route:
    """The dispatch permutation of this rank's T*k assignments."""

    order: torch.Tensor    # [T*k] assignment rows sorted (stably) by expert id
    tokens: torch.Tensor   # [T*k] token of each sorted row: order // k
    counts: torch.Tensor   # [E] int64 rows per expert


def _route(top_k_index: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None) -> _Route:
    """Assignments sorted by expert (stable); dropped ones (``kept`` False) get the sentinel id E,
    sort last and are not sent."""
    flat = top_k_index.reshape(-1)
    if kept is not None:
        flat = torch.where(kept.reshape(-1), flat, torch.full_like(flat, num_experts))
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    order = order[:int(counts.sum())]
    k = max(top_k_index.shape[1], 1)
    return _Route(order, order // k, counts)


def capacity_kept(top_k_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: the assignments a capacity dispatch keeps, GShard/Switch priority: ordered
    choice-major (every token's first choice, then every second choice), each expert keeps its
    first ``capacity`` (autopar.models.moe computes the same, on the same local tokens)."""
    tokens, k = top_k_index.shape
    expert_of = top_k_index.t().reshape(-1)
    onehot = (expert_of.unsqueeze(-1) == torch.arange(num_experts, device=expert_of.device)).to(torch.long)
    position = (torch.cumsum(onehot, dim=0) * onehot).sum(dim=-1) - 1
    return (position < capacity).view(k, tokens).t()


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """One expert on its rows: D (act(G x) * U x), gate_up [2f, h] (gate rows first), down [h, f]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def _local_experts(x: torch.Tensor, recv: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   act) -> torch.Tensor:
    """Run the received rows (ordered by source rank, then local expert; ``recv`` [ep, E/ep])."""
    per = gate_up.shape[0]
    local_id = torch.arange(per, device=x.device).repeat(recv.shape[0])
    row_expert = torch.repeat_interleave(local_id, recv.reshape(-1).to(x.device), output_size=x.shape[0])
    perm = torch.argsort(row_expert, stable=True)
    slices = x[perm].split(recv.sum(0).tolist())
    y = torch.cat([_expert(xs, gate_up[i], down[i], act) for i, xs in enumerate(slices)])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inverse]


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ConfigError(f"timeout must be None or a positive number of seconds, got {timeout!r}")


def expert_parallel_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up_local: torch.Tensor, down_local: torch.Tensor, *, num_experts: int,
                        activation: str, group: Any = None, timeout: float | None = None,
                        capacity: int | None = None) -> torch.Tensor:
    """This rank's MoE experts output [T, h] with the experts split over ``group`` (see the module doc).

    ``hidden`` [T, h] are this rank's tokens, ``top_k_index`` [T, k] global expert ids,
    ``top_k_weights`` [T, k]; ``gate_up_local`` [E/ep, 2f, h] and ``down_local`` [E/ep, h, f]
    are this rank's experts (:func:`shard_experts`). ``group`` None (or of size 1) runs all E
    experts here without communication. ``timeout`` (seconds) bounds every all-to-all; None
    uses blocking collectives under the process group's timeout. ``capacity`` (slots per expert,
    of this rank's tokens) drops the assignments a capacity dispatch would (:func:`capacity_kept`):
    they contribute nothing, as in the model. Every rank of ``group`` must
    call this the same number of times in the same order; differentiable w.r.t. ``hidden``,
    ``top_k_weights`` and the local expert weights.
    """
    act = activation_fn(activation)
    _check_timeout(timeout)
    ep, _ = _group_size_rank(group)
    _check_degree(num_experts, ep)
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up_local, down_local, num_experts, ep)
    _check_ids(top_k_index.reshape(-1), num_experts)
    kept = capacity_kept(top_k_index, num_experts, capacity) if capacity is not None else None
    route = _route(top_k_index, num_experts, kept)
    x_send = hidden[route.tokens]
    if ep == 1:
        y_back = _local_experts(x_send, route.counts.view(1, -1), gate_up_local, down_local, act)
    else:
        recv = _exchange(route.counts, [num_experts // ep] * ep, [num_experts // ep] * ep, group, timeout,
                         "expert-parallel count all-to-all").view(ep, -1)
        send_splits, recv_splits = route.counts.view(ep, -1).sum(1).tolist(), recv.sum(1).tolist()
        x_recv = _AllToAll.apply(x_send, recv_splits, send_splits, group, timeout,
                                 "expert-parallel dispatch all-to-all")
        y_recv = _local_experts(x_recv, recv, gate_up_local, down_local, act)
        y_back = _AllToAll.apply(y_recv, send_splits, recv_splits, group, timeout,
                                 "expert-parallel combine all-to-all")
    weights = top_k_weights.reshape(-1)[route.order].unsqueeze(-1)
    contrib = (y_back * weights).to(hidden.dtype)
    return hidden.new_zeros(hidden.shape).index_add(0, route.tokens, contrib)
