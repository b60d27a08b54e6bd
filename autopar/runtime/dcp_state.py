"""The checkpoint format every autopar program writes and reads, with torch alone.

One flat ``torch.distributed.checkpoint`` (DCP) state dict, the same whether the in-process
runtime (driver/checkpoint.py) or a standalone ``run/train.py`` (codegen/standalone_train.py,
which copies this file beside it) wrote it: a program of any plan resumes either (DCP reshards),
and ``autopar.load_checkpoint`` reads both into one process (tests/distributed/test_checkpoint.py,
test_standalone.py):

- ``<fqn>``: a parameter under its ``model.named_parameters()`` name (a tied parameter's first
  name), persistent buffers and the parameters no pipeline stage holds under their own names;
- ``optim.<fqn>.<state>``: the optimizer's per-parameter state (AdamW: ``exp_avg``,
  ``exp_avg_sq``, ``step``); ``optim.<fqn>.param_group``: that parameter's group hyperparameters
  (pickled: lr, betas, eps, weight decay, ...);
- ``master.<fqn>``: the fp32 master copy of a 16-bit parameter that mixed precision steps (optim.py's
  MasterOptimizer), with the parameter's layout: a resumed program steps from the very masters, not from
  the 16-bit weights widened (a checkpoint without them, or a loader without masters, reads the weights);
- ``autopar.steps``: the steps trained so far.

Every tensor reaches DCP with its *global* layout through a ``present(fqn, tensor)`` function
(:func:`presenter`, from each sharded parameter's :class:`Layout`): a DTensor of the parameter's
global shape, or a plain tensor that the ranks holding it hold whole and identical, which DCP's save
planner deduplicates; a state tensor shaped like its parameter gets the parameter's layout. Loading
asks DCP for the same entries in the loader's own layout, and DCP reads each rank just the
overlapping parts of the saved shards. :func:`save` and :func:`resume` are the one writer and the
one reader: the in-process program, the standalone train.py and the one-process loader call them.

Imports only torch (the standalone folder must run without autopar); ``error`` arguments name
the exception class to raise (autopar passes its ConfigError).
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

OPTIM = "optim."
MASTER = "master."
GROUP = "param_group"
STEPS = "autopar.steps"

# fqn, tensor of that parameter's layout (the parameter or a state tensor) -> what DCP gets
Present = Callable[[str, torch.Tensor], Any]


@dataclass(frozen=True)
class Layout:
    """A sharded parameter's global layout: the tensor a rank holds is its block of a tensor of global
    ``shape`` on ``mesh`` at ``placements`` (tensor parallelism's ``Shard(d)``, expert parallelism's
    ``Shard(0)`` of the experts). A mesh one dim larger than ``placements`` has the parameter's
    replicas as its last dim: FSDP2 may shard the block again over them (the tensor a rank holds is
    then FSDP2's DTensor: ``Shard(0)``) or not (a plain tensor: ``Replicate``)."""
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size


def presenter(layouts: Mapping[str, Layout]) -> Present:
    """``present(fqn, tensor)`` for the parameters of ``layouts`` (the others are whole, or FSDP2's own
    DTensors already): a tensor of that parameter's layout on this rank (the parameter, its local
    shard the optimizer steps, or a state tensor shaped like either) as a DTensor of its global
    layout, a view of the same memory (DCP reads and fills the shard itself)."""
    def present(fqn: str, t: torch.Tensor) -> Any:
        layout = layouts.get(fqn)
        if layout is None or (isinstance(t, DTensor) and t.device_mesh.ndim == layout.mesh.ndim):
            return t
        placements = list(layout.placements)
        if len(placements) < layout.mesh.ndim:   # the replicas' dim
            placements.append(Shard(0) if isinstance(t, DTensor) else Replicate())
        return DTensor.from_local(_local(t), layout.mesh, placements, run_check=False, shape=layout.shape,
                                  stride=contiguous_stride(layout.shape))
    return present


def save(path: str, params: Mapping[str, torch.Tensor], stepped: Mapping[str, torch.Tensor],
         optimizer: torch.optim.Optimizer | None, present: Present, extra: Mapping[str, Any], steps: int,
         masters: Mapping[str, torch.Tensor] | None = None) -> None:
    """Collective: every rank writes its shards. ``params``: fqn -> the parameter this rank holds;
    ``stepped``: fqn -> what the optimizer steps (the parameter, its local shard, or its master copy);
    ``extra``: entries every rank holds whole and alike (persistent buffers, the parameters no stage holds);
    ``masters``: fqn -> the fp32 master of a 16-bit parameter (of the local shard's shape)."""
    state = dict(extra)
    state.update({fqn: present(fqn, p.detach()) for fqn, p in params.items()})
    state.update({MASTER + fqn: present(fqn, m.detach()) for fqn, m in (masters or {}).items()})
    if optimizer is not None:
        state.update(optimizer_state(optimizer, param_names(stepped), present))
    state[STEPS] = int(steps)
    dcp.save(state, checkpoint_id=os.fspath(path))


def resume(path: str, params: Mapping[str, torch.Tensor], stepped: Mapping[str, torch.Tensor],
           optimizer: torch.optim.Optimizer | None, present: Present,
           shape_of: Callable[[str, torch.Tensor], torch.Size], extra: Mapping[str, Any], no_dist: bool = False,
           error: type[Exception] = ValueError, masters: Mapping[str, torch.Tensor] | None = None,
           widen: Callable[[set[str]], None] | None = None) -> int | None:
    """Collective (unless ``no_dist``): fill ``params``, ``extra`` and ``optimizer``'s state in place from
    the checkpoint at ``path``, saved under any plan of the model; returns the steps it had trained
    (None when it does not record them). Arguments as :func:`save`'s; ``shape_of(fqn, p)``: a stepped
    tensor's global shape; ``masters`` are filled from the checkpoint's where it has them, and
    ``widen(names)`` is then called with the others' names (their masters to be copied from the loaded
    weights)."""
    path = os.fspath(path)
    saved = metadata(path, error)
    state: dict[str, Any] = {fqn: present(fqn, p.detach()) for fqn, p in params.items()}
    state.update(extra)
    masters = masters or {}
    state.update({MASTER + fqn: present(fqn, m.detach()) for fqn, m in masters.items() if MASTER + fqn in saved})
    fill = None
    if optimizer is not None:
        fill = optimizer_targets(optimizer, param_names(stepped), saved, present, shape_of, state, error)
    if STEPS in saved:
        state[STEPS] = 0
    load(state, path, saved, no_dist=no_dist, error=error)
    if fill is not None:
        fill()
    missing = {fqn for fqn in masters if MASTER + fqn not in saved}
    if missing and widen is not None:
        widen(missing)
    return int(state[STEPS]) if STEPS in saved else None


def param_names(params: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """id(parameter) -> its fqn in ``params`` (fqn -> parameter); a tied parameter's first name wins."""
    return {id(p): fqn for fqn, p in reversed(list(params.items()))}


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str], present: Present) -> dict[str, Any]:
    """The ``optim.*`` entries of ``optimizer`` (``names``: id(parameter) -> fqn)."""
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = pickle.dumps({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            fqn = names[id(p)]
            out[f"{OPTIM}{fqn}.{GROUP}"] = hyper
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value = present(fqn, value.detach())
                out[f"{OPTIM}{fqn}.{name}"] = value
    return out


def optimizer_targets(optimizer: torch.optim.Optimizer, names: dict[int, str], saved: dict[str, Any],
                      present: Present, shape_of: Callable[[str, torch.Tensor], torch.Size],
                      state: dict[str, Any], error: type[Exception] = ValueError) -> Callable[[], None]:
    """Add to ``state`` a tensor (or placeholder) for every saved optimizer entry of ``optimizer``'s
    parameters; return what installs them once DCP has filled them. ``shape_of(fqn, p)``: the
    parameter's global shape (a state entry of that size takes the parameter's layout; any other
    tensor, AdamW's ``step``, is loaded whole, on the CPU unless the group is ``fused`` or
    ``capturable``, where ``Optimizer.load_state_dict`` puts it). A parameter the checkpoint has no
    state for starts afresh; saved hyperparameters replace its group's."""
    mine_names = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise error("the optimizer holds a tensor that is not one of the model's parameters: make it "
                            "over model.parameters()")
            mine_names.add(names[id(p)])
    entries: dict[str, dict[str, Any]] = {}
    for key, md in saved.items():
        if key.startswith(OPTIM) and (split := split_key(key[len(OPTIM):], mine_names)) is not None:
            entries.setdefault(split[0], {})[split[1]] = md
    todo: list[tuple[dict, torch.Tensor, str, dict[str, Any]]] = []   # (group, param, fqn, name -> value)
    for group in optimizer.param_groups:
        fused = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            fqn = names[id(p)]
            mine: dict[str, Any] = {}
            for name, md in entries.get(fqn, {}).items():
                key = f"{OPTIM}{fqn}.{name}"
                if not isinstance(md, TensorStorageMetadata):
                    state[key] = b""                  # DCP replaces a non-tensor value in the dict
                    mine[name] = None
                    continue
                if md.size == shape_of(fqn, p) and not (name == "step" and not md.size):   # the parameter's layout
                    value = torch.zeros_like(p.detach(), dtype=md.properties.dtype)
                    state[key] = present(fqn, value)
                else:                                # AdamW's step: replicated, loaded whole
                    where = _local(p).device if (fused or name != "step") else torch.device("cpu")
                    value = torch.zeros(md.size, dtype=md.properties.dtype, device=where)
                    state[key] = value
                mine[name] = value
            todo.append((group, p, fqn, mine))

    def fill() -> None:
        for group, p, fqn, mine in todo:
            values = {name: state[f"{OPTIM}{fqn}.{name}"] if value is None else value
                      for name, value in mine.items()}
            hyper = values.pop(GROUP, None)
            if hyper is not None:
                group.update(pickle.loads(hyper))
            if values:
                optimizer.state[p] = values
            else:
                optimizer.state.pop(p, None)
    return fill


def split_key(key: str, names: set[str]) -> tuple[str, str] | None:
    """``<fqn>.<state name>`` -> (fqn, state name) for an fqn of ``names``, the state name dots and all:
    unambiguous, as a parameter's name is never a prefix module of another's."""
    i = len(key)
    while (i := key.rfind(".", 0, i)) > 0:
        if key[:i] in names:
            return key[:i], key[i + 1:]
    return None


def load(state: dict[str, Any], path: str, saved: dict[str, Any], no_dist: bool,
         error: type[Exception] = ValueError) -> None:
    """``dcp.load`` into ``state`` in place; a failure raises ``error`` saying what went wrong."""
    missing = sorted(k for k in state if k not in saved)
    try:
        with warnings.catch_warnings():   # no_dist is what the one-process loader means: no warning about it
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except (Exception, CheckpointException) as exc:   # CheckpointException (a BaseException): raised on every rank
        if missing:
            raise error(f"the checkpoint at {path} lacks {len(missing)} of this model's entries (first: "
                        f"{', '.join(missing[:5])}): it was saved from another model") from exc
        raise error(f"loading the checkpoint at {path} failed: {str(exc).strip().splitlines()[-1][:500]}") from exc


def metadata(path: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The checkpoint's entries: key -> TensorStorageMetadata (size, dtype) or BytesStorageMetadata."""
    if not os.path.isdir(path):
        raise error(f"no checkpoint at {path}: a program's save writes a folder")
    return dict(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def latest(path: str) -> str:
    """``path`` if it is a checkpoint, else its last complete step<N> folder (DCP writes .metadata last)."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    done = sorted(d for d in os.listdir(path)
                  if d.startswith("step") and os.path.exists(os.path.join(path, d, ".metadata")))
    if not done:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return os.path.join(path, done[-1])


def contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(list(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
