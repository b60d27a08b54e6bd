"""Runs one pipeline rank's schedule: forward and backward of its chunks, values over p2p.

Why not ``torch.distributed.pipelining``'s ``PipelineStage`` and schedules: a stage there has
one input and one output edge to its neighbours, while a chunk here may receive from and send
to any earlier or later chunk (skip connections), and the order it runs is the action list of
schedules.py, checked for deadlock before anything is sent.

For every action of this rank, in order:

- ``F(c, i)``: receive the values chunk ``c`` reads from earlier chunks for micro-batch ``i``
  (a blocking receive with a deadline), run the chunk, send each value a later chunk reads
  (non-blocking; a value two chunks on go goes straight there);
- ``B(c, i)``: receive the gradient of each sent value from each chunk that read it (summed),
  backpropagate through the chunk (from the loss, scaled by ``1 / micro_batches``, for the
  last chunk), and send the gradients of the received values back.

Under context parallelism a value crosses a cut as this rank's tokens (context.py's local
shape). Sends between two ranks are matched by tag (gloo) = one per (value, micro-batch, reading
chunk, direction), so their order does not matter; values between two chunks of the same
rank (interleaved) stay in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .chunk import ChunkModule, NodeRunner
from .failures import wait_or_fail
from .graph import SplitGraph
from .schedules import Action
from ..solver.strategies import R
from ..solver.strategies import spec_dim as split_dim


def cut_spec(op_spec: Any) -> str:
    """The spec a value crosses a cut in: the plan's output spec if S(d), else R."""
    return op_spec.output if op_spec is not None and split_dim(op_spec.output) is not None else R


@dataclass
class Topology:
    """Where every chunk runs: global rank of chunk ``c`` for this rank's data / tensor coordinates."""

    pp: int
    rank_of_stage: Sequence[int]       # pipeline rank -> global rank (same dp, tp coordinates)
    my_stage: int

    def rank_of_chunk(self, chunk: int) -> int:
        return self.rank_of_stage[chunk % self.pp]

    def mine(self, chunk: int) -> bool:
        return chunk % self.pp == self.my_stage


@dataclass
class _Pass:
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)    # received values (leaf tensors)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)   # sent values (local, with autograd)


class PipelineRunner:
    """Executes actions for one rank; ``run(actions, micro_batches)`` returns the last chunk's losses."""

    def __init__(self, split: SplitGraph, chunks: Mapping[int, ChunkModule], runner: NodeRunner,
                 topo: Topology, specs: Mapping[str, Any], requires_grad: Callable[[str], bool],
                 timeout: float, before_backward: Callable[[int, bool], None], device: torch.device) -> None:
        self.split = split
        self.chunks = chunks
        self.runner = runner
        self.topo = topo
        self.timeout = timeout
        self.before_backward = before_backward
        self.n_chunks = len(split.chunks)
        crossing = sorted(split.consumers)
        self.value_id = {v: i for i, v in enumerate(crossing)}
        self.spec = {v: self._cut_spec(specs.get(v)) for v in crossing}
        self.requires_grad = {v: requires_grad(v) and self._meta(v).is_floating_point() for v in crossing}
        self.device = device

    # --- one step -----------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], micro: Sequence[Sequence[Any]], scale: float) -> list[torch.Tensor]:
        """Run ``actions``; ``micro[i]`` are micro-batch ``i``'s graph-input tensors by name order."""
        self.m = len(micro)
        self.passes: dict[tuple[int, int], _Pass] = {}
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.pending: list[tuple[Any, str, int]] = []
        last_b = {}
        for k, a in enumerate(actions):
            if a.kind == "B":
                last_b[a.stage] = k
        losses: list[torch.Tensor] = []
        for k, action in enumerate(actions):
            if action.kind == "F":
                loss = self._forward(action, micro[action.micro_batch])
                if loss is not None:
                    losses.append(loss)
            else:
                self.before_backward(action.stage, last_b[action.stage] == k)
                self._backward(action, scale)
        for work, what, peer in self.pending:
            wait_or_fail(work, self.timeout, what, peers=[peer])
        self.pending.clear()
        return losses

    def _forward(self, action: Action, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        c, i = action.stage, action.micro_batch
        chunk = self.chunks[c]
        state = _Pass()
        received = []
        for v in chunk.spec.recv:
            t = self._receive(v, i, c, forward=True)
            if self.requires_grad[v]:
                t = t.detach().requires_grad_(True)
            state.leaves[v] = t
            received.append(t)
        outs = chunk(*[inputs[name] for name in chunk.spec.graph_inputs], *received)
        loss = None
        for v, out in zip(chunk.spec.send, outs):
            if v == self.split.loss:
                loss_local = self.runner.to_cut(c, v, out, R)
                state.outputs[v] = loss_local
                loss = loss_local.detach()
                continue
            t = self.runner.to_cut(c, v, out, self.spec[v])
            state.outputs[v] = t
            for reader in self.split.consumers[v]:
                self._send(t.detach(), v, i, reader, forward=True)
        self.passes[(c, i)] = state
        return loss

    def _backward(self, action: Action, scale: float) -> None:
        c, i = action.stage, action.micro_batch
        state = self.passes.pop((c, i))
        tensors, grads = [], []
        for v, out in state.outputs.items():
            if v == self.split.loss:
                tensors.append(out)
                grads.append(torch.full_like(out, scale))
                continue
            if not self.requires_grad[v]:
                continue
            g = None
            for reader in self.split.consumers[v]:
                got = self._receive(v, i, reader, forward=False)
                g = got if g is None else g + got
            if out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for v, leaf in state.leaves.items():
            if self.requires_grad[v]:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, v, i, c, forward=False)

    # --- values across cuts ---------------------------------------------------------------------
    def _cut_spec(self, op_spec: Any) -> str:
        return cut_spec(op_spec) if self.tp_degree() > 1 else R

    def tp_degree(self) -> int:
        return self.runner.mesh.size() if self.runner.mesh is not None else 1

    def _meta(self, v: str) -> torch.Tensor:
        return self.split.meta(v)

    def _local_shape(self, v: str) -> tuple[int, ...]:
        shape = list(self._meta(v).shape)
        context = self.runner.context
        if context is not None:   # context parallelism: this rank's tokens of a sequence-split value
            shape = list(context.plan.local_shape(v, shape))
        d = split_dim(self.spec[v])
        if d is not None and shape:
            shape[d % len(shape)] //= self.tp_degree()
        return tuple(shape)

    def _tag(self, v: str, i: int, reader: int, forward: bool) -> int:
        return ((self.value_id[v] * self.m + i) * self.n_chunks + reader) * 2 + (0 if forward else 1)

    def _send(self, t: torch.Tensor, v: str, i: int, reader: int, forward: bool) -> None:
        # forward: to the reading chunk; backward: back to the chunk that produced v
        dest_chunk = reader if forward else self.split.producer[v]
        if self.topo.mine(dest_chunk):
            self.mailbox[(v, i, reader, forward)] = t
            return
        peer = self.topo.rank_of_chunk(dest_chunk)
        t = t.contiguous()
        work = dist.isend(t, dst=peer, tag=self._tag(v, i, reader, forward))
        what = f"send of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        self.pending.append((work, what, peer))

    def _receive(self, v: str, i: int, reader: int, forward: bool) -> torch.Tensor:
        src_chunk = self.split.producer[v] if forward else reader
        key = (v, i, reader, forward)
        if self.topo.mine(src_chunk):
            return self.mailbox.pop(key)
        peer = self.topo.rank_of_chunk(src_chunk)
        meta = self._meta(v)
        buf = torch.empty(self._local_shape(v), dtype=meta.dtype, device=self.device)
        work = dist.irecv(buf, src=peer, tag=self._tag(v, i, reader, forward))
        what = f"receive of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        wait_or_fail(work, self.timeout, what, peers=[peer])
        return buf

