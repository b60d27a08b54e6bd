"""Sharded checkpoints of a :class:`~autopar.driver.program.Program` with ``torch.distributed.checkpoint``.

``Program.save_checkpoint(path)`` writes the parameters and the optimizer state with ``dcp.save``:
every rank hands DCP the tensors it holds, each *with its global layout*, and writes only its own
shards (DCP keeps one copy of what several ranks hold). ``Program.load_checkpoint(path)`` builds
the same kind of state dict for the loading program, of any plan of the same model, and
``dcp.load`` reads into it in place, each rank reading just the parts of the saved shards that
overlap its own (DCP's resharding: a load plan asks storage for every saved chunk a local chunk
overlaps, https://pytorch.org/docs/stable/distributed.checkpoint.html). ``load_checkpoint(path,
model, optimizer)`` does the same in one process, into a plain model (``dcp.load(no_dist=True)``).

The format (keys ``<fqn>``, ``optim.<fqn>.<state>``, ``optim.<fqn>.param_group``,
``autopar.steps``; DCP's folder holds one ``.distcp`` file per writing rank and a ``.metadata``) and
the optimizer-state plumbing are runtime/dcp_state.py's, shared with the standalone ``run/train.py``:
the same keys and layouts either way. Persistent buffers and the parameters no chunk holds
(``Program.buffers``, ``Program.unused``) are saved under their own names, so the one-process
loader restores the whole model.

How each tensor carries its global layout:

- tensor-parallel and FSDP2 (ZeRO-2/3) parameters are DTensors already, and so is the optimizer
  state AdamW keeps for FSDP2's (``zeros_like`` of a DTensor); DCP writes ``to_local()`` at the
  offset ``compute_local_shape_and_global_offset`` gives (uneven FSDP2 shards included: both use
  ``torch.chunk``'s split). Without FSDP2 the optimizer steps a tensor-parallel parameter's local
  shard (``Program.stepped``), and its state is plain: both are presented as DTensors of the
  parameter's mesh and placements, views of the same memory;
- offloading the optimizer (``offload="optimizer"``), it steps host copies of what it would step on
  the device (runtime/optim.py's MasterOptimizer: plain tensors of the local shape, ``Program.stepped``
  names them); their state is presented as a local shard's is, and so are the copies themselves
  (``master.<fqn>``: a 16-bit weight's fp32 master, on the device too under mixed precision). Loading
  fills them from the checkpoint's, or, where it has none (saved without masters), copies them from the
  loaded weights;
- expert weights under expert parallelism (``ep > 1``) are plain tensors of this rank's ``E/ep``
  experts (or an FSDP2 shard of them over the expert replicas): they are presented as a DTensor
  of global shape ``[E, ...]`` on a 2-D ``(ep, expert replica)`` mesh with placements
  ``[Shard(0), Shard(0)]`` under ZeRO-2/3 (FSDP2 shards the block of ``E/ep`` experts again) or
  ``[Shard(0), Replicate()]`` otherwise. The mesh is made from the program's existing groups
  (``DeviceMesh.from_group``: no new process group); DCP reads only its coordinates;
- everything else (plain data-parallel replicas, pipeline stages' disjoint parameters, a tied
  parameter held by several stages, AdamW's scalar ``step``) is a plain tensor: the ranks holding
  the same key write identical chunks, which DCP's save planner deduplicates
  (``dedup_save_plans``: one rank writes each chunk);
- ZeRO-1 keeps a parameter's optimizer state on one owner of its data-parallel group: only the
  owner has (and writes) its ``optim.*`` keys, and a ZeRO-1 loader asks for the keys of the
  parameters it owns in its own plan.

Loading allocates the optimizer state from the checkpoint's metadata: a tensor entry shaped like
the parameter gets the parameter's layout (``zeros_like``), any other tensor (``step``) is loaded
whole, on the CPU unless the group is ``fused`` or ``capturable`` (the placement
``torch.optim.Optimizer.load_state_dict`` gives it), then installed as ``optimizer.state[p]``; a
parameter the checkpoint has no state for starts afresh, as AdamW does before its first step.
The group hyperparameters saved with a parameter replace those of its group, as
``Optimizer.load_state_dict`` replaces them. Resuming is exact: the loaded program steps from the
very values the saving one held.

Limits: optimizer state that is neither shaped like its parameter nor replicated (a factored
second moment, Adafactor's row/column statistics of a tensor-parallel shard) is loaded whole and
would not match a sharded parameter. Hyperparameters and non-tensor state are pickled (DCP itself
unpickles non-tensor entries with ``torch.load(weights_only=False)``): load only checkpoints you trust.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..errors import ConfigError
from ..runtime import dcp_state
from ..runtime.optim import MasterOptimizer, innermost, wrapped


def save_program(program: Any, path: str | os.PathLike) -> None:
    """Collective: every rank writes its shards of ``program``'s parameters, masters and optimizer state."""
    extra = dict(program.buffers)
    extra.update({k: v for k, v in program.unused.items() if k not in program.params})
    dcp_state.save(os.fspath(path), program.params, program.stepped, innermost(program.optimizer), _presenter(program),
                   extra, program.steps, _masters(program))


def load_program(program: Any, path: str | os.PathLike) -> None:
    """Collective: fill ``program``'s parameters, masters and optimizer state from the checkpoint at ``path``."""
    masters = _masters(program)   # filled from the checkpoint's, else widened from the weights just loaded
    steps = dcp_state.resume(os.fspath(path), program.params, program.stepped, innermost(program.optimizer),
                             _presenter(program), lambda fqn, p: _global_shape(program, fqn, p),
                             {k: v for k, v in program.unused.items() if k not in program.params}, error=ConfigError,
                             masters=masters, widen=lambda names: wrapped(program.optimizer, MasterOptimizer).reload(
                                 [masters[n] for n in names]))
    if steps is not None:
        program.steps = steps


def _masters(program: Any) -> dict[str, torch.Tensor]:
    """fqn -> the master copy the program's optimizer steps (MasterOptimizer's), for this rank's names."""
    host = wrapped(program.optimizer, MasterOptimizer)
    return host.copies(program.stepped) if host is not None else {}


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int | None:
    """Fill a single-device ``model`` (and ``optimizer``, one over ``model.parameters()``) from a
    checkpoint ``Program.save_checkpoint`` wrote, whatever plan wrote it, in this process alone (no
    process group needed, none used). Returns the steps the saving program had trained (None if
    the checkpoint does not record them). The model must be on a real device (not meta). A parameter
    wider than the 16-bit weight saved for it (an fp32 model, from a mixed-precision program) is filled
    from the weight's saved fp32 master (``master.<fqn>``), which the optimizer state goes with; one of
    the weight's own width reads the weight."""
    path = os.fspath(path)
    saved = dcp_state.metadata(path, ConfigError)
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        raise ConfigError("load_checkpoint fills the model's tensors in place: build it on a real device, or "
                          "materialise a meta model with autopar.init_weights(model) first (and make the "
                          "optimizer after that, over the new parameters)")
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    extra = {k: v for k, v in model.state_dict().items() if k not in aliases and k in saved}
    # a parameter as wide as the saved fp32 master of a 16-bit weight reads the master: the weight is its rounding
    wide = {fqn: p for fqn, p in params.items()
            if fqn in saved and dcp_state.MASTER + fqn in saved and _wider(p.dtype, saved[fqn].properties.dtype)}
    return dcp_state.resume(path, {k: p for k, p in params.items() if k not in wide}, params, optimizer,
                            lambda fqn, t: t, lambda fqn, p: p.shape, extra, no_dist=True, error=ConfigError,
                            masters=wide)


def _wider(mine: torch.dtype, saved: torch.dtype) -> bool:
    return mine.is_floating_point and saved.is_floating_point and mine.itemsize > saved.itemsize


# --- layouts ---------------------------------------------------------------------------------
def _global_shape(program: Any, fqn: str, p: torch.Tensor) -> torch.Size:
    if fqn in program.expert_fqns and program.cfg.ep > 1:
        return torch.Size(program.graph.params[fqn].shape)
    return program.params[fqn].shape   # a DTensor's global shape, also for the local shard the optimizer steps


def _presenter(program: Any) -> dcp_state.Present:
    """dcp_state's presenter over the program's sharded parameters: a tensor-parallel (or 2-D
    tensor-parallel and FSDP2) parameter's own mesh and placements; an expert weight under ep > 1 its
    ``(ep, expert replica)`` mesh (made from the program's groups) with ``Shard(0)`` of the experts."""
    layouts = {fqn: dcp_state.Layout(p.device_mesh, tuple(p.placements), p.shape)
               for fqn, p in program.params.items() if isinstance(p, DTensor)}
    if program.expert_fqns and program.cfg.ep > 1:
        mesh = program.groups.submesh(("ep", "edp"))   # rows this rank's ep group, columns each one's replicas
        layouts.update({fqn: dcp_state.Layout(mesh, (Shard(0),), _global_shape(program, fqn, program.params[fqn]))
                        for fqn in program.expert_fqns if fqn in program.params})
    return dcp_state.presenter(layouts)
