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

This module imports only torch: ``autopar.parallelize`` runs it, and an emitted program
(codegen/standalone.py) carries it as it is. What it needs of the plan comes in as plain data
(:class:`ChunkIO`, :class:`Value`, :class:`Topology`) and functions (``to_cut``, ``wait``: failures.py's
:func:`~.failures.peer_wait`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ChunkIO:
    """What a chunk reads and gives: batch inputs and received values (its forward's arguments, in
    order), and the values it sends on (its forward's outputs; the loss for the last chunk)."""

    graph_inputs: tuple[str, ...]
    recv: tuple[str, ...]
    send: tuple[str, ...]


@dataclass(frozen=True)
class Value:
    """A value crossing a cut: the chunk making it, the later chunks reading it, and the shard a
    receiving rank allocates (this rank's shape and dtype as sent)."""

    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


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
    """Executes actions for one rank; ``run(actions, micro_batches)`` returns the last chunk's losses.

    ``chunks``: this rank's chunk modules; ``io``: every chunk's ChunkIO; ``values``: every value
    crossing a cut; ``loss``: the loss value's name; ``to_cut(chunk, name, value)``: a value as it
    is sent (in the spec it crosses the cut in); ``before_backward(chunk, last)``: called before
    each backward (``last``: the chunk's last of the step); ``wait(work, what, peer)``: waits for a
    point-to-point operation or raises; ``after_forwards(losses)``: called once a step, after this
    rank's last forward, with the losses so far (all of the step's on the rank computing them), so
    that sharing them can start under the backward passes left; ``after_backward(chunk)``: called after
    each chunk's last backward of the step."""

    def __init__(self, chunks: Mapping[int, torch.nn.Module], io: Mapping[int, ChunkIO],
                 values: Mapping[str, Value], loss: str, topo: Topology,
                 to_cut: Callable[[int, str, torch.Tensor], torch.Tensor] | None,
                 before_backward: Callable[[int, bool], None] | None, wait: Callable[[Any, str, int], None],
                 device: torch.device,
                 after_forwards: Callable[[list[torch.Tensor]], None] | None = None,
                 after_backward: Callable[[int], None] | None = None) -> None:
        self.chunks, self.io, self.values, self.loss, self.topo = chunks, io, values, loss, topo
        self.to_cut = to_cut or (lambda chunk, name, value: value)
        self.before_backward = before_backward or (lambda chunk, last: None)
        self.after_forwards = after_forwards or (lambda losses: None)
        self.after_backward = after_backward or (lambda chunk: None)
        self.wait = wait
        self.device = device
        self.n_chunks = len(io)
        self.value_id = {v: i for i, v in enumerate(sorted(values))}

    # --- one step -----------------------------------------------------------------------------
    def run(self, actions: Sequence[Any], micro: Sequence[Mapping[str, Any]], scale: float) -> list[torch.Tensor]:
        """Run ``actions`` (each with ``kind`` "F" / "B", ``stage`` and ``micro_batch``); ``micro[i]`` are
        micro-batch ``i``'s graph inputs by name."""
        self.m = len(micro)
        self.passes: dict[tuple[int, int], _Pass] = {}
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.pending: list[tuple[Any, str, int]] = []
        last_b, last_f = {}, -1
        for k, a in enumerate(actions):
            if a.kind == "B":
                last_b[a.stage] = k
            else:
                last_f = k
        losses: list[torch.Tensor] = []
        for k, action in enumerate(actions):
            if action.kind == "F":
                loss = self._forward(action.stage, action.micro_batch, micro[action.micro_batch])
                if loss is not None:
                    losses.append(loss)
                if k == last_f:
                    self.after_forwards(losses)
            else:
                self.before_backward(action.stage, last_b[action.stage] == k)
                self._backward(action.stage, action.micro_batch, scale)
                if last_b[action.stage] == k:
                    self.after_backward(action.stage)
        for work, what, peer in self.pending:
            self.wait(work, what, peer)
        self.pending.clear()
        return losses

    def _forward(self, c: int, i: int, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        io = self.io[c]
        state = _Pass()
        received = []
        for v in io.recv:
            t = self._receive(v, i, c, forward=True)
            if self.values[v].requires_grad:
                t = t.detach().requires_grad_(True)
            state.leaves[v] = t
            received.append(t)
        outs = self.chunks[c](*[inputs[name] for name in io.graph_inputs], *received)
        loss = None
        for v, out in zip(io.send, outs):
            t = self.to_cut(c, v, out)
            state.outputs[v] = t
            if v == self.loss:
                loss = t.detach()
                continue
            for reader in self.values[v].consumers:
                self._send(t.detach(), v, i, reader, forward=True)
        self.passes[(c, i)] = state
        return loss

    def _backward(self, c: int, i: int, scale: float) -> None:
        state = self.passes.pop((c, i))
        tensors, grads = [], []
        for v, out in state.outputs.items():
            if v == self.loss:
                tensors.append(out)
                grads.append(torch.full_like(out, scale))
                continue
            if not self.values[v].requires_grad:
                continue
            g = None
            for reader in self.values[v].consumers:
                got = self._receive(v, i, reader, forward=False)
                g = got if g is None else g + got
            if out.requires_grad:
                tensors.append(out)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for v, leaf in state.leaves.items():
            if self.values[v].requires_grad:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, v, i, c, forward=False)

    # --- values across cuts ---------------------------------------------------------------------
    def _tag(self, v: str, i: int, reader: int, forward: bool) -> int:
        return ((self.value_id[v] * self.m + i) * self.n_chunks + reader) * 2 + (0 if forward else 1)

    def _send(self, t: torch.Tensor, v: str, i: int, reader: int, forward: bool) -> None:
        # forward: to the reading chunk; backward: back to the chunk that produced v
        dest_chunk = reader if forward else self.values[v].producer
        if self.topo.mine(dest_chunk):
            self.mailbox[(v, i, reader, forward)] = t
            return
        peer = self.topo.rank_of_chunk(dest_chunk)
        t = t.contiguous()
        work = dist.isend(t, dst=peer, tag=self._tag(v, i, reader, forward))
        what = f"send of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        self.pending.append((work, what, peer))

    def _receive(self, v: str, i: int, reader: int, forward: bool) -> torch.Tensor:
        src_chunk = self.values[v].producer if forward else reader
        key = (v, i, reader, forward)
        if self.topo.mine(src_chunk):
            return self.mailbox.pop(key)
        peer = self.topo.rank_of_chunk(src_chunk)
        value = self.values[v]
        buf = torch.empty(value.shape, dtype=value.dtype, device=self.device)
        work = dist.irecv(buf, src=peer, tag=self._tag(v, i, reader, forward))
        what = f"receive of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        self.wait(work, what, peer)
        return buf
