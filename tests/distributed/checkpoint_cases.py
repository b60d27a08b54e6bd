"""Rank-side checkpoint scenarios for test_checkpoint.py, run on the session's gloo worlds (worlds.py).

A scenario trains the source plan's program one step, saves a checkpoint, records the model
(``full_state_dict``) and goes on for two more steps; then, each from a fresh model whose weights
are shifted (so that only the load can make them right):

- a program of the same plan loads the checkpoint and trains the two steps again (resume);
- a program of each target plan loads it and trains one step (resharding), the model built on the
  meta device for some (materialised by parallelize, then overwritten by the load);
- one process (``autopar.load_checkpoint`` into a plain model and AdamW) loads it and trains one step,
  and, as a control, the same with the parameters only (a fresh AdamW: the step must then differ).

Every rank returns numbers (losses, largest differences); the test asserts on them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from harness import MODELS, adamw, batches, call_loss, loss_fn_of, shared_exports

STEPS = 3


def _fresh(model_name: str) -> torch.nn.Module:
    model = MODELS[model_name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    return model


def _program(model_name: str, plan: dict, model: torch.nn.Module | None = None):
    """A program of ``plan`` (each a scenario's source, its resume and its targets: one export per micro-batch
    and device, shared_exports)."""
    import autopar
    with shared_exports(model_name):
        return autopar.parallelize(model if model is not None else _fresh(model_name), autopar.Plan.from_dict(plan),
                                   adamw, loss_fn=loss_fn_of(model_name), timeout=60)


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the same keys (inf when the keys differ)."""
    if set(got) != set(want):
        return float("inf")
    return max(((got[k].float() - want[k].float()).abs().max().item() for k in want if want[k].numel()), default=0.0)


def run(rank: int, world: int, scenarios: list[tuple[str, str, dict, dict[str, tuple[dict, str]]]],
        folder: str) -> dict[str, Any]:
    """``scenarios``: (name, model, source plan, {target name: (plan, model)}); results per scenario name."""
    return {name: _scenario(model_name, source, targets, os.path.join(folder, name))
            for name, model_name, source, targets in scenarios}


def _scenario(model_name: str, source: dict, targets: dict[str, dict], path: str) -> dict[str, Any]:
    import autopar
    data = batches(model_name, STEPS, 4)
    out: dict[str, Any] = {}

    program = _program(model_name, source, MODELS[model_name]())
    losses = [program.train_step(data[0]).item()]
    program.save_checkpoint(path)
    saved = program.full_state_dict()
    afters = []
    for b in data[1:]:
        losses.append(program.train_step(b).item())
        afters.append(program.full_state_dict())
    out["source_losses"] = losses
    del program

    resumed = _program(model_name, source)
    resumed.load_checkpoint(path)
    out["resume_steps"] = resumed.steps
    out["resume_load_diff"] = _diff(resumed.full_state_dict(), saved)
    out["resume_losses"] = losses[:1] + [resumed.train_step(b).item() for b in data[1:]]
    out["resume_state_diff"] = _diff(resumed.full_state_dict(), afters[-1])
    del resumed

    for name, (plan, target_model) in targets.items():
        target = _program(target_model, plan)
        target.load_checkpoint(path)
        out[name] = {"steps": target.steps, "load_diff": _diff(target.full_state_dict(), saved),
                     "loss": target.train_step(data[1]).item()}
        out[name]["params_diff"] = _diff(target.full_state_dict(), afters[0])
        del target

    one: dict[str, Any] = {}
    for label, with_state in (("", True), ("_fresh_optimizer", False)):   # the latter: a control
        model = _fresh(model_name)
        optimizer = adamw(model.parameters())
        steps = autopar.load_checkpoint(path, model, optimizer if with_state else None)
        one["steps" + label], one["load_diff" + label] = steps, _diff(model.state_dict(), saved)
        optimizer.zero_grad()
        loss = call_loss(model, data[1], loss_fn_of(model_name))
        loss.backward()
        optimizer.step()
        one["loss" + label] = loss.item()
        one["params_diff" + label] = _diff(model.state_dict(), afters[0])
    out["one_process"] = one
    return out


def resume_standalone(rank: int, world: int, plan: dict, path: str, steps: int, global_batch: int,
                      lr: float, clip: float | None = None) -> list[float]:
    """A standalone folder's checkpoint (test_standalone.py) loaded by ``autopar.parallelize`` under
    another plan, then trained on from its step to ``steps`` (the gradients clipped to ``clip``, as the folder
    clipped them): the losses of those steps."""
    import autopar
    import plain_factories
    program = autopar.parallelize(plain_factories.llama(), autopar.Plan.from_dict(plan),
                                  lambda ps: torch.optim.AdamW(ps, lr=lr), timeout=60)
    program.load_checkpoint(path)
    return [program.train_step(plain_factories.llama_batch(step, global_batch), max_grad_norm=clip).item()
            for step in range(program.steps, steps)]
