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
  last chunk), and send the gradients of the received values back;
- ``I(c, i)`` and ``W(c, i)`` (the zero-bubble schedules, config.SPLIT_BACKWARD): ``B`` split in two with
  torch.distributed.pipelining's own split (``_backward.stage_backward_input`` / ``stage_backward_weight``).
  ``I`` receives the output gradients as ``B`` does, computes the received values' gradients only
  (``torch.autograd.grad``; the autograd nodes where the weights' paths meet the inputs' keep their
  incoming gradients) and sends them; ``W`` computes the weights' gradients from those nodes.
  Outputs that no received value reaches (every output of a chunk receiving nothing that needs a
  gradient, as torch's first stage) have nothing for ``I`` to do: their whole backward runs at ``W``.
  The weight gradients ``W`` computes are assigned, not accumulated by autograd (no
  post-accumulate-grad hooks fire): a data-parallel reducer starts its buckets when the chunk's last
  ``W`` of the step returns (``after_backward``).

Under context parallelism a value crosses a cut as this rank's tokens (context.py's local
shape). A value every tensor-parallel rank holds whole (:attr:`Value.scatter`) crosses as ``1/t`` of it
from each rank, which the receiving ranks all-gather over their tensor-parallel group (Megatron-LM's
scatter/gather, DeepSpeed's partitioned pipeline buffers): ``t`` times less over the link between
stages, the NICs between nodes, for one all-gather within the node. Its gradient returns the same way:
the gradient of a value held whole is whole and the same on every tensor-parallel rank. Sends between
two ranks are matched by tag (gloo) = one per (value, micro-batch, reading chunk, direction), so their
order does not matter; values between two chunks of the same rank (interleaved, ZB-V) stay in memory.

Chunk ``c`` runs on pipeline device ``c mod pp`` (looped), or where :class:`Topology`'s
``chunk_devices`` says (ZB-V's V: device ``d`` holds chunks ``d`` and ``2 pp - 1 - d``).

This module imports only torch: ``autopar.parallelize`` runs it, and an emitted program
(codegen/standalone.py) carries it as it is. What it needs of the plan comes in as plain data
(:class:`ChunkIO`, :class:`Value`, :class:`Topology`) and functions (``to_cut``, ``wait``: failures.py's
:func:`~.failures.peer_wait`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .failures import Failed, start


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
    scatter: bool = False   # held whole by each tensor-parallel rank: crosses as 1/t of it, all-gathered


@dataclass
class Topology:
    """Where every chunk runs: global rank of chunk ``c`` for this rank's data / tensor coordinates."""

    pp: int
    rank_of_stage: Sequence[int]       # pipeline rank -> global rank (same dp, tp coordinates)
    my_stage: int
    chunk_devices: Sequence[int] | None = None   # chunk -> pipeline rank (ParallelConfig.chunk_device); None:
    #                                              looped, chunk % pp

    def device_of(self, chunk: int) -> int:
        """The pipeline rank running ``chunk``."""
        return chunk % self.pp if self.chunk_devices is None else self.chunk_devices[chunk]

    def rank_of_chunk(self, chunk: int) -> int:
        return self.rank_of_stage[self.device_of(chunk)]

    def mine(self, chunk: int) -> bool:
        return self.device_of(chunk) == self.my_stage


@dataclass
class _Pass:
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)    # received values (leaf tensors)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)   # sent values (local, with autograd)


@dataclass
class _Deferred:
    """What an ``I`` leaves its ``W``: the outputs no received value reaches, with their gradients (their
    whole backward runs at ``W``), and stage_backward_input's parameter groups (None: nothing split)."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor]
    param_groups: list[dict[str, Any]] | None
    weights: list[torch.Tensor]


def backward_ends(actions: Sequence[Any]) -> dict[int, int]:
    """Chunk -> the position in ``actions`` of its last action that completes gradients (``B``, or ``W`` in
    a split schedule): where its gradients of the step are final."""
    return {a.stage: k for k, a in enumerate(actions) if a.kind in ("B", "W")}


def split_backward() -> tuple[Callable, Callable]:
    """torch.distributed.pipelining's split backward, ``(stage_backward_input, stage_backward_weight)``;
    ConfigError on a torch without them."""
    import inspect
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
        usable = ("weights" in inspect.signature(stage_backward_input).parameters
                  and "retain_graph" in inspect.signature(stage_backward_weight).parameters)
    except ImportError:
        usable = False
    if not usable:
        from .errors import ConfigError
        raise ConfigError(f"the zero-bubble schedules (zbh1, zbv, dualpipev) split backwards with torch.distributed."
                          f"pipelining's stage_backward_input / stage_backward_weight, which this torch "
                          f"({torch.__version__}) lacks: install torch >= 2.6, or plan with schedule='1f1b' or "
                          "'interleaved'")
    return stage_backward_input, stage_backward_weight


class _Alias(torch.autograd.Function):
    """The same values as a tensor of its own (no view, no leaf), for stage_backward_input, which detaches its
    outputs in place (a view cannot be); gradient passed through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _own(t: torch.Tensor) -> torch.Tensor:
    return _Alias.apply(t) if t._is_view() or t.grad_fn is None else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)   # a DTensor's local data (no DTensor dispatch per add)


class PipelineRunner:
    """Executes actions for one rank; ``run(actions, micro_batches)`` returns the last chunk's losses.

    ``chunks``: this rank's chunk modules; ``io``: every chunk's ChunkIO; ``values``: every value
    crossing a cut; ``loss``: the loss value's name; ``to_cut(chunk, name, value)``: a value as it
    is sent (in the spec it crosses the cut in); ``before_backward(chunk, last)``: called before
    each pass that completes gradients, ``B`` or ``W`` (``last``: the chunk's last of the step);
    ``wait(work, what, peer)``: waits for a point-to-point operation (or the scattered values' all-gather,
    ``peer`` then its tensor-parallel peers) or raises; ``after_forwards(losses)``:
    called once a step, after this rank's last forward, with the losses so far (all of the step's on the
    rank computing them), so that sharing them can start under the backward passes left;
    ``after_backward(chunk)``: called after each chunk's last ``B`` (or ``W``) of the step; ``tp_group``: the
    tensor-parallel group of this rank, over which the values that cross scattered (:attr:`Value.scatter`)
    are all-gathered (required when any does and it has more than one rank)."""

    def __init__(self, chunks: Mapping[int, torch.nn.Module], io: Mapping[int, ChunkIO],
                 values: Mapping[str, Value], loss: str, topo: Topology,
                 to_cut: Callable[[int, str, torch.Tensor], torch.Tensor] | None,
                 before_backward: Callable[[int, bool], None] | None, wait: Callable[[Any, str, Any], None],
                 device: torch.device,
                 after_forwards: Callable[[list[torch.Tensor]], None] | None = None,
                 after_backward: Callable[[int], None] | None = None, tp_group: Any = None) -> None:
        self.chunks, self.io, self.values, self.loss, self.topo = chunks, io, values, loss, topo
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.tp_peers = [r for r in dist.get_process_group_ranks(tp_group) if r != dist.get_rank()] \
            if tp_group is not None else []
        if tp_group is None and any(v.scatter for v in values.values()):
            raise ValueError("values cross scattered over the tensor-parallel group (Value.scatter), but no "
                             "tp_group was given")
        self.to_cut = to_cut or (lambda chunk, name, value: value)
        self.before_backward = before_backward or (lambda chunk, last: None)
        self.after_forwards = after_forwards or (lambda losses: None)
        self.after_backward = after_backward or (lambda chunk: None)
        self.wait = wait
        self.device = device
        self.n_chunks = len(io)
        self.value_id = {v: i for i, v in enumerate(sorted(values))}
        self._split: tuple[Callable, Callable] | None = None   # split_backward(), once a schedule needs it
        self._reached: dict[int, tuple[bool, ...]] = {}          # chunk -> per output: a received value reaches it

    # --- one step -----------------------------------------------------------------------------
    def run(self, actions: Sequence[Any], micro: Sequence[Mapping[str, Any]], scale: float) -> list[torch.Tensor]:
        """Run ``actions`` (each with ``kind`` "F" / "B" / "I" / "W", ``stage`` and ``micro_batch``); ``micro[i]``
        are micro-batch ``i``'s graph inputs by name."""
        self.m = len(micro)
        self.passes: dict[tuple[int, int], _Pass] = {}
        self.deferred: dict[tuple[int, int], _Deferred] = {}
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.pending: list[tuple[Any, str, int]] = []
        last_b = backward_ends(actions)
        last_f = max((k for k, a in enumerate(actions) if a.kind == "F"), default=-1)
        if self._split is None and any(a.kind in ("I", "W") for a in actions):
            self._split = split_backward()
        losses: list[torch.Tensor] = []
        for k, action in enumerate(actions):
            c, i = action.stage, action.micro_batch
            if action.kind == "F":
                loss = self._forward(c, i, micro[i])
                if loss is not None:
                    losses.append(loss)
                if k == last_f:
                    self.after_forwards(losses)
            elif action.kind == "I":
                self._input_backward(c, i, scale)
            else:   # "B", "W": the passes that complete gradients
                self.before_backward(c, last_b[c] == k)
                if action.kind == "B":
                    self._backward(c, i, scale)
                else:
                    self._weight_backward(c, i)
                if last_b[c] == k:
                    self.after_backward(c)
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

    def _output_grads(self, state: _Pass, i: int, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk's outputs that backpropagate and their gradients: the loss's ``scale``, each sent value's
        received from its readers (summed)."""
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
        return tensors, grads

    def _backward(self, c: int, i: int, scale: float) -> None:
        state = self.passes.pop((c, i))
        tensors, grads = self._output_grads(state, i, scale)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for v, leaf in state.leaves.items():
            if self.values[v].requires_grad:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, v, i, c, forward=False)

    def _input_backward(self, c: int, i: int, scale: float) -> None:
        """``I(c, i)``: the received values' gradients, sent back; the weights' part kept for ``W(c, i)``."""
        state = self.passes.pop((c, i))
        tensors, grads = self._output_grads(state, i, scale)
        names = [v for v, leaf in state.leaves.items() if self.values[v].requires_grad]
        leaves = [state.leaves[v] for v in names]
        weights = [p for p in self.chunks[c].parameters() if p.requires_grad]
        reached = self._reached.get(c)
        if reached is None:
            reached = self._reached[c] = _reached(tensors, leaves)
        split = [k for k, r in enumerate(reached) if r]
        whole = [k for k, r in enumerate(reached) if not r]
        groups, dinputs = None, [None] * len(leaves)
        if split:
            stage_backward_input = self._split[0]
            dinputs, groups = stage_backward_input([_own(tensors[k]) for k in split], [grads[k] for k in split],
                                                   leaves, iter(weights))
        for v, leaf, g in zip(names, leaves, dinputs):
            self._send(g if g is not None else torch.zeros_like(leaf), v, i, c, forward=False)
        self.deferred[(c, i)] = _Deferred([tensors[k] for k in whole], [grads[k] for k in whole], groups, weights)

    def _weight_backward(self, c: int, i: int) -> None:
        """``W(c, i)``: the weights' gradients, added to theirs; then the whole backward of the outputs no received
        value reaches (through autograd's accumulation, last: a data-parallel hook it fires sees the weight's
        final gradient of the pass)."""
        d = self.deferred.pop((c, i))
        if d.param_groups is not None:
            # stage_backward_weight assigns each weight the gradient autograd.grad returned and adds later ones
            # into it in place; autograd may return one tensor (or views of one) for several weights
            # (``x + a + b``), which AccumulateGrad would copy: each weight's first gradient of the step is
            # copied here, into memory of its own, and later ones added into that
            before = [w.grad for w in d.weights]
            for w in d.weights:
                w.grad = None
            # several groups may share graph below their intermediates (HF T5's position bias, computed once for
            # every block): each group's autograd.grad keeps the graph for the next, freed when W returns
            self._split[1](iter(d.weights), d.param_groups, retain_graph=bool(d.outputs) or len(d.param_groups) > 1)
            for w, old in zip(d.weights, before):
                new = w.grad
                if new is None:
                    w.grad = old
                elif old is None:
                    w.grad = new.clone(memory_format=torch.contiguous_format)
                else:
                    _local(old).add_(_local(new))
                    w.grad = old
        if d.outputs:
            torch.autograd.backward(d.outputs, d.grads)

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
        if self._scattered(v):   # this rank's 1/t of a value every tensor-parallel rank holds whole
            t = t.reshape(-1).chunk(self.tp)[self.tp_rank]
        work = start(dist.isend, t, dst=peer, tag=self._tag(v, i, reader, forward))
        what = f"send of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        if isinstance(work, Failed):
            self.wait(work, what, peer)   # raises, naming the peer
        self.pending.append((work, what, peer))

    def _receive(self, v: str, i: int, reader: int, forward: bool) -> torch.Tensor:
        src_chunk = self.values[v].producer if forward else reader
        key = (v, i, reader, forward)
        if self.topo.mine(src_chunk):
            return self.mailbox.pop(key)
        peer = self.topo.rank_of_chunk(src_chunk)
        value = self.values[v]
        scattered = self._scattered(v)
        numel = math.prod(value.shape)
        buf = torch.empty(numel // self.tp if scattered else value.shape, dtype=value.dtype, device=self.device)
        work = start(dist.irecv, buf, src=peer, tag=self._tag(v, i, reader, forward))
        what = f"receive of {'value' if forward else 'gradient of'} {v} (micro-batch {i})"
        self.wait(work, what, peer)
        if not scattered:
            return buf
        whole = torch.empty(numel, dtype=value.dtype, device=self.device)
        work = start(dist.all_gather_into_tensor, whole, buf, group=self.tp_group, async_op=True)
        self.wait(work, f"tensor-parallel all-gather of the {what}", self.tp_peers)
        return whole.view(value.shape)

    def _scattered(self, v: str) -> bool:
        return self.tp > 1 and self.values[v].scatter


def _reached(outputs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """Per output: whether a received value (``leaves``) reaches it in the autograd graph. stage_backward_input
    finds the weights' gradients only where their paths meet the received values', so an output none reaches
    (a chunk receiving nothing that needs a gradient: all of them) backpropagates whole at ``W``."""
    if not leaves:
        return tuple(False for _ in outputs)
    from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                        reverse_closure)
    roots = [_get_grad_fn_or_grad_acc(t) for t in outputs]
    edges = construct_reverse_graph([r for r in roots if r is not None])
    closure, _ = reverse_closure([_get_grad_fn_or_grad_acc(t) for t in leaves], set(), edges)
    return tuple(r is not None and r in closure for r in roots)
