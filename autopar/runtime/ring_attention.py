"""Context-parallel (ring) attention over a sequence split across the ``cp`` ranks of a process group.

Semantics. ``ring_attention(q, k, v, ...)`` on this rank's tokens equals
``F.scaled_dot_product_attention`` of the full (unsharded) q, k, v, sharded back to this rank's
rows; an ``attn_mask`` given together with ``is_causal`` means both (their AND), as SDPA does on
CPU. Rows whose every key is masked give 0 (as SDPA does), never NaN.

Layout ("head-tail", Megatron-LM / torchtitan causal load balancing). The ``S`` positions are cut
into ``2 cp`` chunks of ``c = S / (2 cp)`` tokens; rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, in that order (``local_indices``), so ``s_local = S / cp = 2 c``. Under a causal
mask query chunk ``a`` sees ``a c^2 + c (c + 1) / 2`` (query, key) pairs, so rank ``r`` sees
``(r + 2 cp - 1 - r) c^2 + c (c + 1) = (2 cp - 1) c^2 + c (c + 1)`` pairs: the same on every rank.
Per ring step the work is equal too: the own block is lower-triangular (local order is increasing
in position); a block from rank ``src < r`` is needed only for its head chunk (all of this rank's
queries are later), a block from ``src > r`` only by this rank's tail chunk. ``_active_box`` finds
that half from the mask, so every off-diagonal step computes exactly ``s_local^2 / 2`` scores.

Blockwise softmax (FlashAttention's rule, ``block_attention``). For queries ``Q`` and one key block
``j`` with scores ``S_j = scale Q K_j^T + M_j`` (``M_j``: 0 keep, -inf drop):
``lse_j = log sum_k exp(S_j)``, ``O_j = exp(S_j - lse_j) V_j``. Two partial results merge exactly:
``lse = logaddexp(lse_a, lse_b)``, ``O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b``
(``_merge``). A row with no kept key in a block has ``lse_j = -inf`` and ``O_j = 0``; the merge
uses ``lse = 0`` in place of ``-inf`` in the exponents, so such rows weigh 0 and never give NaN.

Backward (``block_attention_backward``), with the final ``O`` and ``lse`` of the whole row:
``P_j = exp(S_j - lse)``, ``D = rowsum(dO * O)``, ``dV_j = P_j^T dO``,
``dS_j = P_j * (dO V_j^T - D)``, ``dQ += scale dS_j K_j``, ``dK_j = scale dS_j^T Q``.

Ring. Rank ``r`` sends to ``r + 1`` and receives from ``r - 1`` (mod ``cp``); at step ``j`` it holds
the K/V block of rank ``(r - j) mod cp``. Forward: before computing step ``j`` it posts the
isend/irecv of that block (``batch_isend_irecv``), so the transfer of block ``j + 1`` overlaps the
compute of block ``j``; ``cp - 1`` transfers of ``2 b h_kv s_local d`` elements each. Backward:
K/V circulate the same way, and each block's dK/dV accumulator travels with it: rank ``r`` adds
its share for the block it holds and passes the sum on; after ``cp`` hops the accumulator is back
on the block's owner with every rank's share. The accumulator sent at step ``j`` is waited on
only after the compute of step ``j + 1``, so it overlaps too. Per step that is twice the forward
volume (K/V plus dK/dV; the dK/dV accumulator is float32 or float64, whatever the input dtype).
Every wait has a deadline (``failures.wait_or_fail``).

Only ``s_local x s_local`` score blocks are formed, never ``S x S``; the mask's rows for this
rank (``s_local x S``) are sliced once from the caller's full mask.

Block kernel: on CPU the fused ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
``_backward`` (they match the math path to ~1e-6 in float32 and ~1e-15 in float64). Two fixes
around it: it refuses bool masks (the mask must have the query's dtype), so masks are made
additive; and for a fully masked row it returns ``lse = 0`` (output 0), which the merge would read
as weight 1, so ``lse`` is set to -inf there from the mask. Elsewhere the ``_math`` path runs; it is
also the reference the tests compare the fused one against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError
from .failures import Failed, start, wait_or_fail

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for one p2p transfer before failing the run
_NEG_INF = float("-inf")
_TAG_FWD_KV, _TAG_BWD_KV, _TAG_BWD_DKV = 0, 1, 2


# ---------------------------------------------------------------------------------------- layout

def local_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Sequence positions rank ``rank`` of ``cp`` holds, in its local order: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks (head-tail causal load balancing)."""
    if cp < 1:
        raise ConfigError(f"context parallelism cp={cp} is invalid: use cp >= 1")
    if not 0 <= rank < cp:
        raise ConfigError(f"rank {rank} is outside the context-parallel group of size {cp}: use 0 <= rank < {cp}")
    if seq_len <= 0 or seq_len % (2 * cp) != 0:
        raise ConfigError(f"sequence length {seq_len} cannot be cut into 2*cp = {2 * cp} equal chunks for context "
                          f"parallelism cp={cp}: pick a sequence length that is a multiple of {2 * cp} (pad it) "
                          "or change cp")
    c = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def shard_sequence(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of ``t`` along ``dim`` (any dim, negative too), in local order."""
    return t.index_select(dim, local_indices(t.shape[dim], cp, rank).to(t.device))


def gather_sequence(t: torch.Tensor, dim: int, cp: int, rank: int, group: Any = None,
                    timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """The full sequence along ``dim`` in original order, on every rank (all-gather).

    Autograd: every rank may use the result, so the gradient of this rank's shard is the sum
    over ranks of their gradients at this rank's positions (a reduce-scatter)."""
    _check_group(group, cp, rank)
    if cp == 1:
        return t
    return _GatherSequence.apply(t, dim % t.dim(), cp, rank, group, timeout)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dim, cp, rank, group, timeout):  # type: ignore[override]
        ctx.dim, ctx.cp, ctx.rank, ctx.group, ctx.timeout = dim, cp, rank, group, timeout
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(cp)]
        wait_or_fail(start(dist.all_gather, parts, t, group=group, async_op=True), timeout,
                     "all_gather of a context-parallel sequence", group)
        order = torch.cat([local_indices(t.shape[dim] * cp, cp, r) for r in range(cp)]).to(t.device)
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # all_reduce then slice: gloo has no reduce_scatter; costs 2x a reduce-scatter's volume.
        grad = grad.contiguous().clone()
        wait_or_fail(start(dist.all_reduce, grad, group=ctx.group, async_op=True), ctx.timeout,
                     "all_reduce of a gathered sequence's gradient", ctx.group)
        return shard_sequence(grad, ctx.dim, ctx.cp, ctx.rank), None, None, None, None, None


# ---------------------------------------------------------------------------------- block kernel

def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` [b, h, s_q, d] over one key block ``k``, ``v`` [b, h, s_k, d].

    ``mask``: bool (True keeps) or additive float, broadcastable to [b, h, s_q, s_k]. Returns
    ``(out, lse)``, ``lse`` [b, h, s_q] the log-sum-exp of the scaled, masked scores; a row with no
    kept key has ``out = 0`` and ``lse = -inf``. Computes in float32 (float64 for float64 input)."""
    q, k, v = (x.to(_compute_dtype(q.dtype)) for x in (q, k, v))
    mask, scale = _additive(mask, q.dtype), _scale(q, scale)
    if _fused_ok(q):
        return _block_attention_fused(q, k, v, mask, scale)
    return block_attention_math(q, k, v, mask, scale)


def block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None = None,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one key block, given the FINAL ``out`` and ``lse`` of the rows (over all
    blocks), so that summing over blocks gives the gradient of the whole attention."""
    dout, q, k, v, out = (x.to(_compute_dtype(q.dtype)) for x in (dout, q, k, v, out))
    mask, scale = _additive(mask, q.dtype), _scale(q, scale)
    if _fused_ok(q):
        return _block_attention_backward_fused(dout, q, k, v, out, lse, mask, scale)
    return block_attention_backward_math(dout, q, k, v, out, lse, mask, scale)


def block_attention_math(q, k, v, mask, scale):
    """Reference of ``block_attention`` (additive ``mask`` or None, inputs in the compute dtype)."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return p @ v, lse


def block_attention_backward_math(dout, q, k, v, out, lse, mask, scale):
    """Reference of ``block_attention_backward`` (FlashAttention-2's backward, one block)."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse.to(q.dtype)).unsqueeze(-1))
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - delta)
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout


def _block_attention_fused(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)
    if mask is not None:  # the kernel reports lse = 0 for a row with no kept key; the merge needs -inf
        lse = lse.masked_fill((mask == _NEG_INF).all(-1).expand_as(lse), _NEG_INF)
    return out, lse


def _block_attention_backward_fused(dout, q, k, v, out, lse, mask, scale):
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), _finite(lse.to(q.dtype)).contiguous(), 0.0, False,
        attn_mask=mask, scale=scale)
    return tuple(grads)


def _fused_ok(q: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _scores(q, k, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores + mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows with no kept key) replaced by 0, so ``exp(-inf - lse)`` is 0, not NaN."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, _NEG_INF)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
           rows: slice) -> None:
    """Fold one block's ``(out, lse)`` into the running ones at ``rows``, in place (log-sum-exp rule)."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    base = _finite(new_lse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old_lse - base).unsqueeze(-1)
                         + block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse[..., rows] = new_lse


# ------------------------------------------------------------------------------------------ masks

def _mask_rows(attn_mask: torch.Tensor | None, seq_len: int, q: torch.Tensor,
               q_pos: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of the full mask, [b', h', s_local, S] (b', h' either 1 or full)."""
    if attn_mask is None:
        return None
    if attn_mask.dim() > 4 or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise ConfigError(f"attn_mask of shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype} is not a bool or "
                          f"float mask broadcastable to [b, hq, S, S] = {[q.shape[0], q.shape[1], seq_len, seq_len]}: "
                          "pass the full-sequence mask, identical on every rank")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    full = (q.shape[0], q.shape[1], seq_len, seq_len)
    if any(have not in (1, want) for have, want in zip(m.shape, full)):
        raise ConfigError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [b, hq, S, S] = "
                          f"{list(full)} (S = s_local * cp): pass the mask of the whole sequence, not of one shard")
    return m.expand(*m.shape[:2], seq_len, seq_len).index_select(-2, q_pos.to(m.device))


def _block_mask(mask_rows: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool,
                dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask of one (query block, key block) pair, or None when every pair is kept."""
    keep = q_pos[:, None] >= k_pos[None, :] if is_causal else None
    if mask_rows is None:
        return None if keep is None or bool(keep.all()) else _additive(keep, dtype)
    m = mask_rows.index_select(-1, k_pos.to(mask_rows.device))
    if m.dtype == torch.bool:
        return _additive(m if keep is None else m & keep, dtype)
    return m.to(dtype) if keep is None else m.to(dtype).masked_fill(~keep, _NEG_INF)


def _active_box(mask: torch.Tensor | None, s_q: int, s_k: int) -> tuple[slice, slice] | None:
    """Smallest (rows, cols) ranges holding every kept pair of a block mask; None if none is kept."""
    if mask is None:
        return slice(0, s_q), slice(0, s_k)
    live = (mask != _NEG_INF).reshape(-1, s_q, s_k).any(0)
    rows, cols = live.any(-1).nonzero().flatten(), live.any(-2).nonzero().flatten()
    if rows.numel() == 0:
        return None
    return slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)


# ------------------------------------------------------------------------------------------- ring

@dataclass(frozen=True)
class _Ring:
    """Point-to-point neighbours of one rank in the context-parallel ring."""
    group: Any
    cp: int
    rank: int
    timeout: float

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @property
    def peers(self) -> list[int]:
        return [self._global((self.rank - 1) % self.cp), self._global((self.rank + 1) % self.cp)]

    def post(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list, torch.Tensor]:
        """Start sending ``t`` to the next rank and receiving its like from the previous one."""
        if self.cp == 1:
            return t, [], t
        t = t.contiguous()
        buf = torch.empty_like(t)
        prev, nxt = self.peers
        works = start(dist.batch_isend_irecv, [dist.P2POp(dist.isend, t, nxt, self.group, tag),
                                               dist.P2POp(dist.irecv, buf, prev, self.group, tag)])
        works = [works] if isinstance(works, Failed) else works
        return buf, works, t  # t stays referenced until the send completes

    def wait(self, posted: tuple[torch.Tensor, list, torch.Tensor], what: str) -> torch.Tensor:
        buf, works, _ = posted
        for work in works:
            wait_or_fail(work, self.timeout, what, self.group, peers=self.peers)
        return buf


# -------------------------------------------------------------------------------- ring attention

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, cp: int, rank: int,
                   is_causal: bool = False, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   scale: float | None = None, enable_gqa: bool = False,
                   timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of the full sequence, for this rank's queries.

    ``q`` [b, hq, s_local, d], ``k``/``v`` [b, hkv, s_local, d]: this rank's tokens in the
    ``local_indices`` layout (``S = s_local * cp``). ``attn_mask``: the mask of the WHOLE sequence
    (bool keep-mask or additive float, broadcastable to [b, hq, S, S]), the same on every rank; no
    gradient flows to it. ``is_causal`` compares global positions. ``timeout``: seconds per wait."""
    _check_args(q, k, v, cp, dropout_p, enable_gqa)
    _check_group(group, cp, rank)
    seq_len = q.shape[-2] * cp
    q_pos = local_indices(seq_len, cp, rank).to(q.device)
    mask_rows = _mask_rows(attn_mask, seq_len, q, q_pos)
    ring = _Ring(group, cp, rank, float(timeout))
    return _RingAttention.apply(q, k, v, mask_rows, bool(is_causal), _scale(q, scale), ring)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_rows, is_causal, scale, ring):  # type: ignore[override]
        cdt, groups = _compute_dtype(q.dtype), q.shape[1] // k.shape[1]
        qc = q.to(cdt)
        out = torch.zeros(q.shape, dtype=cdt, device=q.device)
        lse = torch.full(q.shape[:-1], _NEG_INF, dtype=cdt, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.cp):
            posted = ring.post(kv, _TAG_FWD_KV) if step < ring.cp - 1 else None
            block = _Block(ring, step, q, mask_rows, is_causal, cdt)
            if block.box is not None:
                rows, cols = block.box
                o, l = block_attention(qc[..., rows, :], _heads(kv[0, ..., cols, :], groups, cdt),
                                       _heads(kv[1, ..., cols, :], groups, cdt), block.mask, scale)
                _merge(out, lse, o, l, rows)
            if posted is not None:
                kv = ring.wait(posted, f"ring attention forward: K/V block of step {step + 1}")
        ctx.save_for_backward(q, k, v, out, lse, mask_rows)
        ctx.is_causal, ctx.scale, ctx.ring = is_causal, scale, ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, mask_rows = ctx.saved_tensors
        ring, cdt, groups = ctx.ring, out.dtype, q.shape[1] // k.shape[1]
        qc, dout = q.to(cdt), dout.to(cdt)
        dq = torch.zeros_like(qc)
        kv, acc_posted = torch.stack([k, v]), None
        for step in range(ring.cp):
            posted = ring.post(kv, _TAG_BWD_KV) if step < ring.cp - 1 else None
            block = _Block(ring, step, q, mask_rows, ctx.is_causal, cdt)
            dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
            if block.box is not None:
                rows, cols = block.box
                dqb, dkb, dvb = block_attention_backward(
                    dout[..., rows, :], qc[..., rows, :], _heads(kv[0, ..., cols, :], groups, cdt),
                    _heads(kv[1, ..., cols, :], groups, cdt), out[..., rows, :], lse[..., rows], block.mask,
                    ctx.scale)
                dq[..., rows, :] += dqb
                dkv[0, ..., cols, :] = _sum_heads(dkb, groups)
                dkv[1, ..., cols, :] = _sum_heads(dvb, groups)
            if acc_posted is not None:  # the accumulator of the block now held, from the ranks before
                dkv += ring.wait(acc_posted, f"ring attention backward: dK/dV accumulator of step {step}")
            acc_posted = ring.post(dkv, _TAG_BWD_DKV)
            if posted is not None:
                kv = ring.wait(posted, f"ring attention backward: K/V block of step {step + 1}")
        dkv = ring.wait(acc_posted, "ring attention backward: this rank's summed dK/dV")
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class _Block:
    """Step ``step``'s key block for this rank: its additive mask and active (rows, cols) box."""

    def __init__(self, ring: _Ring, step: int, q: torch.Tensor, mask_rows, is_causal: bool, dtype: torch.dtype):
        s_local = q.shape[-2]
        seq_len = s_local * ring.cp
        q_pos = local_indices(seq_len, ring.cp, ring.rank).to(q.device)
        k_pos = local_indices(seq_len, ring.cp, (ring.rank - step) % ring.cp).to(q.device)
        mask = _block_mask(mask_rows, q_pos, k_pos, is_causal, dtype)
        self.box = _active_box(mask, s_local, s_local)
        self.mask = None if mask is None or self.box is None else mask[..., self.box[0], self.box[1]]


def _heads(t: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """K or V [b, hkv, s, d] with each head repeated ``groups`` times (GQA), in ``dtype``."""
    t = t.to(dtype)
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (t.shape[1] // groups, groups)).sum(2)


def _check_args(q, k, v, cp, dropout_p, enable_gqa) -> None:
    if dropout_p:
        raise ConfigError(f"ring_attention got dropout_p={dropout_p}: attention dropout is not supported under "
                          "context parallelism; use dropout_p=0.0")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.shape[0], q.shape[2], q.shape[3]) != (
            k.shape[0], k.shape[2], k.shape[3]):
        raise ConfigError(f"ring_attention needs q [b, hq, s_local, d] and k, v [b, hkv, s_local, d] of the same b, "
                          f"s_local and d; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not q.is_floating_point():
        raise ConfigError(f"ring_attention needs floating-point q, k, v; got {q.dtype}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and (not enable_gqa or hq % hkv):
        raise ConfigError(f"q has {hq} heads and k/v {hkv}: pass enable_gqa=True with hkv dividing hq "
                          "(grouped-query attention), as for F.scaled_dot_product_attention")


def _check_group(group: Any, cp: int, rank: int) -> None:
    if cp == 1 and not dist.is_initialized():
        return
    if not dist.is_initialized():
        raise ConfigError(f"context parallelism cp={cp} needs torch.distributed: call "
                          "torch.distributed.init_process_group first")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if (size, me) != (cp, rank):
        raise ConfigError(f"cp={cp}, rank={rank} do not match the process group (size {size}, this rank {me}): "
                          "pass the context-parallel group and this rank's index in it")
