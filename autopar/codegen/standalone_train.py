#!/usr/bin/env python
"""Train a plan compiled by autopar (``autopar codegen --standalone``), with torch alone.

Run on each node:  torchrun --nproc-per-node <ranks per node> train.py --steps 10

program.py (beside this file) holds the plan's constants, each layer's code on its shards and each
chunk's dataflow; autopar_runtime/ (beside it: autopar's runtime library, torch alone) runs it: the
pipeline executor and checked schedule (pipeline.py), the global batch cut into micro-batches
(batches.py), the optimizer step compiled under --compile (optim.py), the explicit collectives
(collectives.py / shard_ops.py / context_ops.py), the Mesh (mesh.py: a rank's coordinates and
process groups), the gradients' reduction (data_parallel.py), the step's losses to every rank
(losses.py), waits with deadlines and failures naming the rank and step (failures.py), the
checkpoint format (dcp_state.py): the very files ``autopar.parallelize`` runs. This file builds a
rank's share: its process groups, its shards of the weights of the model ``MODEL_FACTORY`` builds
(the same seed on every rank, so the same weights; a model built on the meta device gets the values
of the parameters and buffers this rank holds only, one module at a time: sharded_init.py), FSDP2
for ZeRO-2/3, an fp8 plan's linear layers through torchao's float8 training (fp8.py: torchao is then needed
beside torch), AdamW; then per step: the rank's micro-batches (under context parallelism its tokens
of each sequence) through the schedule, the gradient reductions (the mean over the data- and
context-parallel replicas, tied parameters, tensor-parallel partial sums), the optimizer step, and
the mean loss over the global batch (rank 0 prints it and appends it to --loss-file).
--checkpoint / --resume write and read sharded checkpoints (torch.distributed.checkpoint) in the
format of dcp_state.py, the one ``autopar.parallelize``'s programs write (the same keys, each tensor
with its global layout, so DCP reshards it to the reader's plan); ``autopar.load_checkpoint``
reads it into one process.
This file is copied from autopar's codegen/standalone_train.py; it imports nothing of autopar but the
runtime library copied beside it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import sys
from collections import namedtuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autopar_runtime import (batches, data_parallel, dcp_state, failures, host_heap, losses, mesh, optim,  # noqa: E402
                             pipeline, sharded_init)
import program as P  # noqa: E402

if P.CP > 1:   # context parallelism's (program.py's code calls them)
    from autopar_runtime import context_ops, context_state

Action = namedtuple("Action", "kind stage micro_batch")


def load(ref):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def actions(text):
    """"F0.0 B0.0" (or "F0.0 I0.0 W0.0") -> Actions."""
    return [Action(a[0], int(a[1:].split(".")[0]), int(a.split(".")[1])) for a in text.split()]


# The ranks a weight's gradient is averaged over: the data-parallel ranks and, within each, the
# context-parallel ones (each holds every weight and its tokens' gradient): mesh.py's "dp" group.
REPLICAS = P.DP * P.CP
MESH = mesh.Mesh(pp=P.PP, dp=P.DP, cp=P.CP, tp=P.TP)


def shards(model, value, pp_rank, tp_rank, device):
    """This rank's parameters on ``device``: its stage's, each its block along the tensor-parallel split dim."""
    full = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for fqn in P.STAGE_PARAMS[pp_rank]:
        piece = value(fqn)
        d = P.TP_DIMS.get(fqn)
        if d is not None:
            piece = piece.chunk(P.TP, d)[tp_rank]
        out[fqn] = torch.nn.Parameter(piece.to(device, copy=True), requires_grad=full[fqn].requires_grad)
    return out


def micro_batches(batch, dp_rank, cp_rank, device):
    """This replica's micro-batches: graph input -> rows of the global batch (under context
    parallelism, of the inputs that start sharded, this rank's tokens)."""
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    out = []
    for rows in batches.replica_micro_batches(batch, dp_rank, P.DP, P.MICRO_BATCH_SIZE, P.MICRO_BATCHES,
                                              P.GLOBAL_BATCH):
        inputs = {name: rows[key].to(device) if isinstance(rows[key], torch.Tensor) else rows[key]
                  for name, key in P.INPUTS}
        if P.CP > 1:
            seeds = {name: context_state.Local(*layout) for name, layout in P.CONTEXT_INPUTS.items()}
            inputs = context_ops.shard_inputs(inputs, seeds, P.CP, cp_rank)
        out.append(inputs)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=P.LR)
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's initial weights, the same on every "
                        "rank (a model built on the meta device: each module's from the seed and its name, as "
                        "autopar.parallelize's init_seed)")
    parser.add_argument("--clip-grad", type=float, default=None, help="clip the gradients to this total norm before "
                        "every step (the whole model's norm, as torch.nn.utils.clip_grad_norm_ on one device: optim.py)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait on a silent peer")
    parser.add_argument("--loss-file", default=None, help="rank 0 appends each step's loss here")
    parser.add_argument("--compile", action="store_true", help="run each chunk (each layer under ZeRO-2/3) "
                        "and the optimizer step through torch.compile")
    parser.add_argument("--checkpoint", default=None, help="save a sharded checkpoint (parameters, optimizer "
                        "state, step) into DIR/step<N> after the last step (torch.distributed.checkpoint)")
    parser.add_argument("--save-every", type=int, default=0, help="with --checkpoint: also every N steps")
    parser.add_argument("--resume", default=None, help="start from a checkpoint (a step<N> folder, or a "
                        "--checkpoint DIR: its latest one) saved by this folder or by autopar under any plan; "
                        "--steps counts from the start of the run")
    args = parser.parse_args()
    if args.compile and P.SPLIT_BACKWARD:
        parser.error("--compile: this plan's zero-bubble schedule splits each chunk's backward into an input- and "
                     "a weight-gradient pass, and a compiled chunk's backward is one node that cannot be split: run "
                     "without --compile, or re-emit a plan with schedule='1f1b' or 'interleaved'")

    owned = not dist.is_initialized()   # a caller (a driver running several programs) may have made it
    if owned:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout))
    cuda = dist.get_backend() == "nccl"   # a caller's gloo group runs on the CPU, GPU or not
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        host_heap.keep_freed_memory()   # the step's buffers reused, not faulted in again each step
    P.DEVICE = device   # where the generated code creates its tensors
    rank = dist.get_rank()
    at = MESH.coords(rank)
    pp_rank, dp_rank, cp_rank, tp_rank = at.pp, at.dp, at.cp, at.tp
    if P.CP > 1:   # what the generated code's context-parallel calls read
        P.CP_RANK, P.TIMEOUT = cp_rank, args.timeout
    # every process group (every rank creates every group, in the same order, as torch.distributed
    # requires): the (pp, dp, cp, tp) device mesh, and a group per set of stages holding a tied parameter
    g = MESH.build(device.type, tied=P.TIED.values())

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = load(P.MODEL_FACTORY)()
    model = model[0] if isinstance(model, tuple) else model
    # fqn -> a parameter's or buffer's full value: the model's own, or for one on the meta device the
    # value sharded_init gives it, one module at a time
    value = sharded_init.Materializer(model, args.seed).tensor
    params = shards(model, value, pp_rank, tp_rank, device)
    checkpointing = bool(args.checkpoint or args.resume)
    whole = whole_entries(model, value) if checkpointing else {}
    shapes = {fqn: p.shape for fqn, p in model.named_parameters()}   # global shapes, for the checkpoint's layouts
    buffers = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "buffers.pt"))
    buffers.update({k: value(fqn) for k, fqn in P.META_BUFFERS.items()})
    buffers = {k: v.to(device) for k, v in buffers.items()}
    del model, value
    mine = [c for c in range(P.CHUNKS) if P.CHUNK_DEVICES[c] == pp_rank]
    fp8_linear = None
    if P.FP8_RECIPE is not None:   # the plan's linear layers through torchao's float8 training (fp8.py)
        from autopar_runtime import fp8
        fp8_linear = fp8.Float8Linear(P.FP8_RECIPE, fp8.emulated(device), g.tp)
        # the weights FSDP2 gathers in fp8 (FP8_GATHERED): torchao's cast-before-gather weights
        params = {f: fp8.gathered_in_fp8(p, fp8_linear) if f in P.FP8_GATHERED else p for f, p in params.items()}
    chunks = {c: getattr(P, f"Chunk{c}")(g.group("tp"), params, buffers, cp_group=g.group("cp"), fp8=fp8_linear)
              for c in mine}
    fsdp = P.ZERO >= 2 and (REPLICAS > 1 or P.OFFLOAD == "all")
    if fsdp:   # ZeRO-2/3: each unit's parameters sharded over the gradient replicas (the dp x cp mesh; with
        # tp > 1 each tp rank's shards are sharded again over it), gathered around it
        for c, chunk in chunks.items():
            for unit, kept in P.UNITS[c]:
                modules = [chunk.layers[k] for k in unit]
                data_parallel.shard_unit(modules if len(modules) > 1 else modules[0], P.OFFLOAD == "all",
                                         bool(P.FP8_GATHERED), mesh=g.dp, reshard_after_forward=P.ZERO == 3 and not kept)
            data_parallel.shard_unit(chunk, P.OFFLOAD == "all", bool(P.FP8_GATHERED), mesh=g.dp,
                                     reshard_after_forward=False)   # the root: small runs, kept
    if args.compile:
        for chunk in chunks.values():
            for module in (chunk.layers if fsdp else [chunk]):
                module.compile()
    parameters = list({id(p): p for c in chunks.values() for p in c.parameters()}.values())
    adamw = lambda ps: torch.optim.AdamW(ps, lr=args.lr)   # noqa: E731
    make = adamw
    if P.OFFLOAD == "optimizer":   # the states and the step on the host, over copies of the weights (optim.MasterOptimizer)
        make = lambda ps: optim.MasterOptimizer(ps, adamw, P.MASTER_WEIGHTS)   # noqa: E731
    elif optim.MasterOptimizer.needed(parameters, P.MASTER_WEIGHTS):   # fp32 masters of 16-bit weights, on the device
        make = lambda ps: optim.MasterOptimizer(ps, adamw, host=False)   # noqa: E731
    if P.ZERO == 1 and REPLICAS > 1:   # ZeRO-1: each replica keeps the states of, and steps, its share of the
        # parameters, then sends what it stepped to the others (optim.Zero1Optimizer, as parallelize's)
        replicas = g.dp.get_group()
        optimizer = optim.Zero1Optimizer([(parameters, replicas, dist.get_process_group_ranks(replicas))],
                                                 make, rank, args.timeout)
        if rank == 0:
            print(f"ZeRO-1: rank 0 keeps the optimizer states of {len(optimizer.mine)} of its {len(optimizer.params)} "
                  "parameters", flush=True)
    else:
        optimizer = make(parameters)
    if args.compile and optim.innermost(optimizer) is not None:   # and its step, from the second on (optim.py)
        optim.compile_step(optim.innermost(optimizer), "inductor")
    named = {fqn: p for c in chunks.values() for fqn, p in _named(c).items()}
    host = optim.wrapped(optimizer, optim.MasterOptimizer)
    stepped = host.stepped(named) if host is not None else named   # what the checkpoint's state names
    masters = host.copies(stepped) if host is not None else {}      # saved beside the weights (dcp_state.py)

    io = {c: pipeline.ChunkIO(*P.CHUNK_IO[c]) for c in P.CHUNK_IO}
    values = {v: pipeline.Value(prod, readers, shape, getattr(torch, dtype.removeprefix("torch.")), grad, scatter)
              for v, (prod, readers, shape, dtype, grad, scatter) in P.VALUES.items()}
    stages = list(g.ranks("pp"))
    # ZeRO 0-1 with replicas: the gradients' bucketed all-reduce over them (as parallelize's), each chunk's
    # buckets started as its last backward of the step runs (FSDP2 reduce-scatters its own)
    schedule = actions(P.SCHEDULE[pp_rank])
    ends = pipeline.backward_ends(schedule)   # a parameter two of its chunks hold: reduced with the one ending last
    reducer = data_parallel.GradReducer(data_parallel.dedupe([list(_named(chunks[c]).values()) for c in mine],
                                                             [ends[c] for c in mine]),
                                        g.dp.get_group(), REPLICAS, args.timeout) if not fsdp and REPLICAS > 1 else None
    if reducer is not None and isinstance(optimizer, optim.Zero1Optimizer):   # ZeRO-1: each gradient summed
        # onto the replica that steps it, but those more sums follow (tensor-parallel partial, tied)
        reducer.reduce_to_owners(optimizer.owners(named, {*P.TP_PARTIAL, *P.TIED}))
    # the step's micro-batch losses to every rank, started after this rank's last forward (as parallelize's)
    owner = pp_rank == P.CHUNK_DEVICES[-1] and tp_rank == 0   # the last chunk's, which computes the loss
    share = losses.LossShare(P.SHARES_LOSSES, P.LOSSES_RIDE, owner, P.DP, dp_rank,
                             P.MICRO_BATCHES, P.CP, device, args.timeout, getattr(torch, P.LOSS_DTYPE), reducer)

    def before_backward(chunk, last):
        if reducer is not None and last:
            reducer.start(mine.index(chunk))

    def after_backward(chunk):
        if reducer is not None:
            reducer.ended(mine.index(chunk))
    topology = pipeline.Topology(P.PP, stages, pp_rank, P.CHUNK_DEVICES)
    runner = pipeline.PipelineRunner(chunks, io, values, P.LOSS, topology, None, before_backward,
                                     failures.peer_wait(args.timeout), device, after_forwards=share.start,
                                     after_backward=after_backward, tp_group=g.tp.get_group() if g.tp is not None else None)
    batch_of = load(P.BATCH_FACTORY) if P.BATCH_FACTORY else (lambda step, n: batches.example_at(P.EXAMPLE, n))
    present = presenter(g, fsdp, shapes, named) if checkpointing else None
    start = 0
    if args.resume:   # collective: every rank reads its own shards, resharded to this plan
        # the masters from the checkpoint's, or (saved without them) copied from the weights just loaded
        start = dcp_state.resume(dcp_state.latest(args.resume), named, stepped, optim.innermost(optimizer), present,
                                 lambda fqn, p: shapes[fqn], {}, masters=masters,
                                 widen=lambda names: host.reload([masters[n] for n in names])) or 0
        if rank == 0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
    # the weights FSDP2 gathers in fp8: their scales refreshed before each step's first gather (fp8.py)
    fp8_weights = fp8.fp8_gathered(parameters) if P.FP8_GATHERED and fsdp else []
    for step in range(start, args.steps):
        with failures.at_step(step, "the training step"):
            optimizer.zero_grad(set_to_none=True)
            if fp8_weights:
                fp8.refresh_scales(fp8_weights, g.dp.get_group(), fp8_linear)
            runner.run(schedule, micro_batches(batch_of(step, P.GLOBAL_BATCH), dp_rank, cp_rank, device),
                       1.0 / P.MICRO_BATCHES)
            if reducer is not None:   # the mean over the replicas
                reducer.finish()
            # then the sums parallelize makes too: tensor-parallel partial gradients, then tied parameters
            data_parallel.all_reduce_grads([(f"{fqn}'s tensor-parallel gradient", named[fqn], g.group("tp"))
                                            for fqn in P.TP_PARTIAL if fqn in named], args.timeout)
            data_parallel.all_reduce_grads([(f"tied parameter {fqn}'s gradient", named[fqn], g.tied[tuple(stages)])
                                            for fqn, stages in sorted(P.TIED.items()) if fqn in named], args.timeout)
            micro_losses = share.result()   # every replica's, on every rank: every rank stops alike
            failure = failures.non_finite_loss(micro_losses, rank, step, P.MICRO_BATCHES, P.MICRO_BATCH_SIZE,
                                               P.GLOBAL_BATCH // P.DP)
            if failure is not None:
                raise failure
            loss = micro_losses.mean().item()
            norm = None
            if args.clip_grad is not None:   # every element of the model counted on one rank (optim.norm_pieces)
                pieces = optim.norm_pieces(named, lambda fqn: fqn not in P.TIED or min(P.TIED[fqn]) == pp_rank,
                                           lambda fqn: P.TP > 1 and fqn in P.TP_DIMS, tp_rank,
                                           [reducer] if reducer is not None else [])
                total = optim.clip_grad_norm_(pieces, args.clip_grad, 2.0, args.timeout)
                failure = failures.non_finite_norm(total, rank, step)   # the same norm on every rank: all stop
                if failure is not None:
                    raise failure
                norm = total.item()
            optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss:.6f}" + (f" grad norm {norm:.9g}" if norm is not None else ""), flush=True)
            if args.loss_file:
                with open(args.loss_file, "a") as fh:
                    fh.write(f"{loss:.9g}\n")
        if args.checkpoint and (step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
            dcp_state.save(os.path.join(args.checkpoint, f"step{step + 1:08d}"), named, stepped,
                           optim.innermost(optimizer), present, whole, step + 1, masters)
    dist.barrier()
    del runner, chunks
    gc.collect()
    if owned:
        dist.destroy_process_group()


def _named(chunk):
    """Parameter fqn -> the parameter this chunk holds (shared on the chunk, the rest on its layers)."""
    out = {n.replace("__", "."): p for n, p in chunk._parameters.items()}
    for layer in chunk.layers:
        out.update({n.replace("__", "."): p for n, p in layer._parameters.items()})
    return out


def whole_entries(model, value):
    """What a checkpoint holds besides the stages' parameters, the same on every rank: the model's
    persistent buffers and the parameters no stage holds, under their own names."""
    held = {fqn for fqns in P.STAGE_PARAMS.values() for fqn in fqns}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out = {k: value(k).clone() for k in model.state_dict() if k not in aliases}
    out.update({fqn: value(fqn).clone() for fqn, _ in model.named_parameters() if fqn not in held})
    return out


def presenter(g, fsdp, shapes, named):
    """dcp_state's presenter: a tensor-parallel block is a block of the parameter on this stage's tp
    mesh at Shard(split dim); under ZeRO-2/3 every parameter is FSDP2's DTensor, whose own layout presents
    the plain local shards an offloaded optimizer steps (its host copies), except that of a tensor-parallel
    block, which FSDP2 shards as a whole tensor of the block's shape: it is presented on the (dp, tp) mesh,
    FSDP2's rows of the rank's block (strided over the tp blocks when both split dim 0); anything else is
    whole."""
    from torch.distributed.tensor import DTensor, Shard
    if fsdp:
        from torch.distributed.tensor.placement_types import _StridedShard
        layouts = {}
        for fqn, p in named.items():
            if not isinstance(p, DTensor):
                continue
            if fqn in P.TP_DIMS and P.TP > 1:
                d = P.TP_DIMS[fqn] % len(shapes[fqn])
                rows = _StridedShard(0, split_factor=P.TP) if d == 0 else Shard(0)
                layouts[fqn] = dcp_state.Layout(g.submesh(("dp", "tp")), (rows, Shard(d)), shapes[fqn])
            else:
                layouts[fqn] = dcp_state.Layout(p.device_mesh, tuple(p.placements), p.shape)
        return dcp_state.presenter(layouts)
    if P.TP == 1:
        return dcp_state.presenter({})
    return dcp_state.presenter({fqn: dcp_state.Layout(g.tp, (Shard(d % len(shapes[fqn])),), shapes[fqn])
                                for fqn, d in P.TP_DIMS.items()})


if __name__ == "__main__":
    main()
