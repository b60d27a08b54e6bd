r"""Op profiling: the model's own ops timed forward and backward on this machine.

For a micro-batch size ``b`` the model is exported at ``b`` (as ``parallelize`` does, so the
timed ops are the ops the program runs) and its graph is run once, node by node, on real
inputs (the example inputs' rows repeated up to ``b``). Every captured op is keyed by its
*signature* (target, shapes, dtypes, which inputs need gradients, non-tensor arguments);
each distinct signature is timed once, in isolation, on its own inputs:

    forward   t_f = median over repeats of  op(*inputs)             (autograd recording, as in training)
    backward  t_b = median over repeats of  autograd.grad(outputs, inputs needing grad, dy)

so the four decoder layers of a GPT cost one measurement. Calls shorter than 1 ms are timed
in loops of ``ceil(1 ms / t)`` calls. Results go to the ProfileDB (section "ops").

Tensor parallelism divides an op's work by the shard count ``s`` along a dimension whose choice
the layout makes. Measuring every op at every split is what Alpa does; here the two classes of
op are treated as follows:

* a GEMM (``OpNode.gemm`` = batch x (m x k) @ (k x n)) is re-timed as a plain (batched)
  matrix multiply at the sharded shape ``G_s`` and at the full one ``G_1`` (forward one
  product, backward the two of dX and dW), and the op's measured time is scaled by their ratio:
  ``t_s = t_op * t_mm(G_s) / t_mm(G_1)``. Thin shards run at a lower efficiency than ``1/s`` of
  the time would say, and the ratio carries that;
* any other op moves ``1/s`` of the bytes: ``t_s = t_0 + (t_op - t_0) / s`` with ``t_0`` the
  device's measured per-kernel overhead, which does not shrink.

Isolated timings miss what running the ops back to back costs: inputs no longer hot in cache,
the autograd engine, gradient accumulation, the backward of views. So the whole forward and
backward pass of the model at ``b`` is timed too (eager, as the user's module runs), and every
op's forward (backward) time is scaled by ``T_pass / sum_ops t`` of the forward (backward):
the op profile says where the time goes, the pass says how much there is (ratios of 1.1-1.2
on a CPU). Both the raw op times and the pass are cached.

Views cost nothing (capture's convention), and the runtime's per-op host overhead under
tensor parallelism is the device's ``dispatch_overhead`` (cost_model/layer_cost.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..capture import graph_of, param_aliases
from ..capture.export import LossFn, LossWrapper, normalize_inputs, run_export
from ..capture.opgraph import Gemm, OpGraph, OpKind, OpNode
from ..runtime.optim import compile_step
from ..errors import ConfigError
from ..config import PRECISION_DTYPES
from ..ops import SKIPPED_TARGETS
from .database import ProfileDB
from ..progress import progress_bar
from .host import median_time, torch_threads

_UNTIMED = (OpKind.VIEW,)
_LOOP_SECONDS = 1e-3


@dataclass(frozen=True)
class OpTiming:
    """Measured seconds of one op signature (``bwd_seconds`` 0 when nothing needs a gradient)."""

    fwd_seconds: float
    bwd_seconds: float

    def to_record(self) -> dict[str, float]:
        return {"fwd_seconds": self.fwd_seconds, "bwd_seconds": self.bwd_seconds}


def tile_inputs(example_inputs: Any, captured: int, batch_size: int) -> Any:
    """The example inputs (batch ``captured``) with dim 0 of every batched tensor made ``batch_size`` by
    repeating rows: real token ids and masks, so embedding lookups and masks behave as in training."""
    args, kwargs = normalize_inputs(example_inputs)

    def tile(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != captured:
            return t
        rows = torch.arange(batch_size, device=t.device) % captured
        return t.index_select(0, rows)

    args, kwargs = pytree.tree_map(tile, (args, kwargs))
    if isinstance(example_inputs, Mapping):
        return kwargs
    return args[0] if isinstance(example_inputs, torch.Tensor) else args


def _flag(t: torch.Tensor, needs_grad: bool) -> str:
    layout = "" if t.is_contiguous() else "~"
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}{layout}{'g' if needs_grad else ''}"


def signature(target: Any, args: tuple, kwargs: dict, needs_grad: Mapping[int, bool]) -> str:
    """Key of one op call: its target and every argument (tensors by dtype, shape, layout and
    whether they need a gradient, ``needs_grad`` keyed by ``id``)."""
    def describe(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return _flag(a, needs_grad.get(id(a), False))
        return repr(a)

    leaves = pytree.tree_map(describe, (args, kwargs))
    return f"{target}{leaves}"


def _looped(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of one ``fn()``; calls under 1 ms run in loops so the timer's resolution does not matter."""
    once = median_time(fn, device, warmup=1, repeats=1)
    loops = max(1, math.ceil(_LOOP_SECONDS / max(once, 1e-9))) if once < _LOOP_SECONDS else 1

    def many() -> None:
        for _ in range(loops):
            fn()
    return median_time(many, device, warmup=warmup, repeats=repeats) / loops


def time_op(target: Any, args: tuple, kwargs: dict, grad_inputs: Mapping[int, bool], device: torch.device,
            warmup: int, repeats: int) -> OpTiming:
    """Forward and backward seconds of ``target(*args, **kwargs)``; the tensors whose ``id`` maps to True in
    ``grad_inputs`` are made leaves that need a gradient."""
    def leaf(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach().requires_grad_(grad_inputs.get(id(a), False) and a.is_floating_point())
        return a

    call_args, call_kwargs = pytree.tree_map(leaf, (args, kwargs))
    leaves = [a for a in pytree.tree_leaves((call_args, call_kwargs)) if isinstance(a, torch.Tensor)
              and a.requires_grad]
    with torch.enable_grad():
        fwd = _looped(lambda: target(*call_args, **call_kwargs), device, warmup, repeats)
        out = target(*call_args, **call_kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not leaves or not outs:
            return OpTiming(fwd, 0.0)
        grads = [torch.randn_like(o) for o in outs]
        bwd = _looped(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True),
                      device, warmup, repeats)
    return OpTiming(fwd, bwd)


def time_gemm(gemm: Gemm, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int) -> OpTiming:
    """A plain batched matrix multiply of ``gemm``'s shape: forward ``X W``, backward ``dY W^T`` and ``X^T dY``."""
    b, m, n, k = gemm.batch, gemm.m, gemm.n, gemm.k
    x = torch.randn(b, m, k, dtype=dtype, device=device)
    w = torch.randn(b, k, n, dtype=dtype, device=device)
    dy = torch.randn(b, m, n, dtype=dtype, device=device)
    fwd = _looped(lambda: torch.bmm(x, w), device, warmup, repeats)
    bwd = _looped(lambda: (torch.bmm(dy, w.transpose(1, 2)), torch.bmm(x.transpose(1, 2), dy)), device, warmup,
                  repeats)
    return OpTiming(fwd, bwd)


@dataclass
class _Walk:
    """One export of the model at one micro-batch size, run node by node."""

    program: Any
    graph: OpGraph
    inputs: Any
    model: nn.Module

    def run(self, visit: Callable[[torch.fx.Node, tuple, dict, Mapping[int, bool]], None]) -> None:
        """Compute every node (no autograd; which values need a gradient is tracked by hand) and call
        ``visit`` on each captured op with its concrete arguments."""
        from torch.export.graph_signature import InputKind

        from ..codegen.split import flatten_batch, placeholders

        program = self.program
        param_of, buffer_value = placeholders(program, param_aliases(self.model))
        params = dict(self.model.named_parameters())
        users = [s.arg.name for s in program.graph_signature.input_specs if s.kind is InputKind.USER_INPUT]
        env: dict[str, Any] = dict(zip(users, flatten_batch(self.inputs, program.call_spec.in_spec)))
        grad: dict[str, bool] = {}
        for name, fqn in param_of.items():
            env[name] = params[fqn].detach()
            grad[name] = params[fqn].requires_grad
        env.update(buffer_value)
        nodes = list(program.graph.nodes)
        last_use: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last_use[a.name] = i
        captured = {n.name for n in self.graph.nodes if n.kind not in _UNTIMED}
        for i, node in enumerate(nodes):
            if node.op == "get_attr":
                env[node.name] = getattr(program.graph_module, node.target)
            elif node.op == "call_function" and str(node.target) not in SKIPPED_TARGETS:
                args = torch.fx.node.map_arg(node.args, lambda a: env[a.name])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env[a.name])
                needs = {}
                for a in node.all_input_nodes:
                    value = env.get(a.name)
                    for t in pytree.tree_leaves(value):
                        if isinstance(t, torch.Tensor):
                            needs[id(t)] = grad.get(a.name, False)
                if node.name in captured:
                    visit(node, args, kwargs, needs)
                with torch.no_grad():
                    env[node.name] = node.target(*args, **kwargs)
                grad[node.name] = any(grad.get(a.name, False) for a in node.all_input_nodes) and any(
                    isinstance(t, torch.Tensor) and t.is_floating_point() for t in pytree.tree_leaves(env[node.name]))
            for a in node.all_input_nodes:
                if last_use.get(a.name) == i and a.op == "call_function":
                    env.pop(a.name, None)


@dataclass
class OpProfiler:
    """Measured op times of one model on this machine: the cost model's ``MeasuredTimes``.

    Profiles a micro-batch size the first time the cost model asks for it (export, one
    node-by-node run, one timing per distinct op signature not yet in the database), and
    GEMM shards the first time a tensor-parallel split of them is asked for."""

    model: nn.Module
    example_inputs: Any
    graph: OpGraph                       # the planning graph (captured at the example batch)
    device_name: str                     # the ProfileDB key of this device (host.device_name)
    db: ProfileDB
    loss_fn: LossFn | None = None
    threads: int = 1
    kernel_overhead: float = 0.0         # seconds per op that a tensor-parallel shard does not divide
    warmup: int = 2
    repeats: int = 5
    progress: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _by_batch: dict[int, dict[str, OpTiming]] = field(default_factory=dict)
    _gemms: dict[str, OpTiming] = field(default_factory=dict)     # by the "gemm ..." database key
    timed: int = 0                       # op signatures measured (not found in the database)
    reused: int = 0                      # op calls whose signature was in the database
    untimed: set[str] = field(default_factory=set)  # ops that could not run alone (priced analytically)
    in_context: dict[int, tuple[float, float]] = field(default_factory=dict)  # mbs -> (fwd, bwd) whole / sum
    _optimizer: dict[bool, float] = field(default_factory=dict)   # compiled? -> seconds per parameter

    def __post_init__(self) -> None:
        dtypes = {p.dtype for p in self.model.parameters() if p.is_floating_point()}
        if len(dtypes) > 1:
            raise ConfigError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}: profile=True times the "
                              "ops as they run, so cast the model to one dtype first")
        dtype = next(iter(dtypes), torch.float32)
        if str(dtype).removeprefix("torch.") not in PRECISION_DTYPES:
            raise ConfigError(f"profile=True times float32 / bfloat16 / float16 models; this one is {dtype}")
        self.dtype = dtype
        self.dtype_name = PRECISION_DTYPES[str(dtype).removeprefix("torch.")]

    # --- MeasuredTimes ----------------------------------------------------------------------
    def lookup(self, node: OpNode, batch_scale: float, shard: int, split_dim: str, dtype: str
               ) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds of the planning graph's ``node`` at micro-batch
        ``batch_scale * graph.batch_size`` split ``shard`` ways along ``split_dim``; None when the op
        could not be timed (the analytic model prices it) or the cost model asks for another dtype."""
        if dtype != self.dtype_name or node.kind in _UNTIMED:
            return None
        mbs = max(1, round(batch_scale * self.graph.batch_size))
        timing = self.timings(mbs).get(node.name)
        if timing is None:
            return None
        if shard <= 1:
            return timing.fwd_seconds, timing.bwd_seconds
        if node.gemm is not None and node.kind is OpKind.MATMUL and split_dim:
            return self._gemm_shard(node, timing, mbs, shard, split_dim)
        t0 = self.kernel_overhead
        return tuple(t0 + max(t - t0, 0.0) / shard if t > 0 else 0.0
                     for t in (timing.fwd_seconds, timing.bwd_seconds))

    def summary(self) -> str:
        """One line for the plan's notes: what was measured, reused and left to the analytic model."""
        batches = ", ".join(str(b) for b in sorted(self._by_batch))
        left = f"; priced analytically (cannot run alone): {sorted(self.untimed)}" if self.untimed else ""
        factors = ", ".join(f"{b}: x{f:.2f}/x{g:.2f}" for b, (f, g) in sorted(self.in_context.items()))
        return (f"op times measured on {self.device_name} at micro-batch {batches}: {self.timed} op signatures "
                f"timed, {self.reused} op calls found in {self.db.path}; whole pass / sum of ops (fwd/bwd) "
                f"{factors}{left}")

    def optimizer_seconds_per_param(self, kernels: str = "eager") -> float:
        """Seconds per parameter of one ``torch.optim.AdamW`` step on tensors shaped like the model's
        trainable parameters, random gradients, as a program running ``kernels`` steps it: eager, the
        default implementation for the device (single-tensor on a CPU, multi-tensor on CUDA), on every
        parameter's shape; otherwise through ``torch.compile`` as a compiled program steps it
        (runtime/optim.py), on one tensor of each distinct shape (compiling costs about a quarter of a
        second per tensor on a CPU, and the compiled update's time is its elements' streaming)."""
        compiled = kernels != "eager"
        if compiled not in self._optimizer:
            key = f"adamw{' compiled' if compiled else ''} {self.graph.content_hash}"
            record = self.db.get(self.device_name, "ops", key)
            if record is None:
                params = [p for p in self.model.parameters() if p.requires_grad]
                if compiled:
                    params = list({(tuple(p.shape), p.dtype): p for p in params}.values())
                params = [torch.randn_like(p).requires_grad_() for p in params]
                for p in params:
                    p.grad = torch.randn_like(p)
                opt = torch.optim.AdamW(params, lr=1e-4)
                if compiled:   # its first call eager (the state), the second compiles
                    compile_step(opt, "inductor")
                with torch_threads(self.threads):
                    seconds = median_time(opt.step, self.device, warmup=self.warmup + 2 * compiled,
                                          repeats=self.repeats)
                record = {"step_seconds": seconds, "params": sum(p.numel() for p in params)}
                self.db.put(self.device_name, "ops", key, record)
                self.db.save()
            self._optimizer[compiled] = record["step_seconds"] / max(1, record["params"])
        return self._optimizer[compiled]

    # --- profiling --------------------------------------------------------------------------
    def timings(self, micro_batch: int) -> dict[str, OpTiming]:
        """Planning-graph node name -> measured timing at ``micro_batch`` (profiled on first use)."""
        if micro_batch not in self._by_batch:
            self._by_batch[micro_batch] = self._profile(micro_batch)
        return self._by_batch[micro_batch]

    def _profile(self, micro_batch: int) -> dict[str, OpTiming]:
        inputs = tile_inputs(self.example_inputs, self.graph.batch_size, micro_batch)
        program = run_export(self.model, inputs, self.loss_fn)
        running = graph_of(self.model, program)
        walk = _Walk(program, running, inputs, self.model)
        by_running: dict[str, OpTiming] = {}
        bar = iter(progress_bar(range(len(running.nodes)), f"profiling ops at micro-batch {micro_batch}",
                                enabled=self.progress))

        def visit(node: torch.fx.Node, args: tuple, kwargs: dict, needs: Mapping[int, bool]) -> None:
            next(bar, None)
            key = signature(node.target, args, kwargs, needs)
            record = self.db.get(self.device_name, "ops", key)
            if record is None:
                timing = self._time(node, args, kwargs, needs)
                if timing is None:
                    self.untimed.add(str(node.target))
                    return
                self.db.put(self.device_name, "ops", key, timing.to_record())
                self.timed += 1
            else:
                timing = OpTiming(record["fwd_seconds"], record["bwd_seconds"])
                self.reused += 1
            by_running[node.name] = timing

        with torch_threads(self.threads):
            walk.run(visit)
            whole = self._whole_pass(inputs, micro_batch, running.content_hash)
        self.db.save()
        fwd_sum = sum(t.fwd_seconds for t in by_running.values())
        bwd_sum = sum(t.bwd_seconds for t in by_running.values())
        rf = whole.fwd_seconds / fwd_sum if fwd_sum > 0 else 1.0
        rb = whole.bwd_seconds / bwd_sum if bwd_sum > 0 else 1.0
        self.in_context[micro_batch] = (rf, rb)
        # the same op in both exports by its structural identity; volatile ops have none (capture/structure.py)
        names = {n.name: running.node_of.get(i) for n, i in zip(self.graph.nodes, self.graph.op_ids) if i is not None}
        return {planned: OpTiming(by_running[name].fwd_seconds * rf, by_running[name].bwd_seconds * rb)
                for planned, name in names.items() if name in by_running}

    def _whole_pass(self, inputs: Any, micro_batch: int, graph_key: str) -> OpTiming:
        """Seconds of the model's whole forward (to the loss) and backward at this micro-batch, run as
        the user's module would run (eager, autograd)."""
        key = f"pass {graph_key} b{micro_batch}"
        record = self.db.get(self.device_name, "ops", key)
        if record is not None:
            return OpTiming(record["fwd_seconds"], record["bwd_seconds"])
        wrapper = LossWrapper(self.model, self.loss_fn, inputs)
        args, kwargs = normalize_inputs(inputs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.enable_grad():
            fwd = median_time(lambda: wrapper(*args, **kwargs), self.device, warmup=1, repeats=self.repeats)
            # the backward is timed on its own (one forward, its graph kept, backward repeated), never as
            # (forward + backward) - forward: on a busy machine that difference of two medians can be <= 0
            loss = wrapper(*args, **kwargs)
            bwd = median_time(lambda: torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True),
                              self.device, warmup=1, repeats=self.repeats)
        timing = OpTiming(fwd, bwd)
        self.db.put(self.device_name, "ops", key, timing.to_record())
        return timing

    def _time(self, node: torch.fx.Node, args: tuple, kwargs: dict, needs: Mapping[int, bool]) -> OpTiming | None:
        try:
            return time_op(node.target, args, kwargs, needs, self.device, self.warmup, self.repeats)
        except (RuntimeError, NotImplementedError, TypeError):
            # an op that cannot run alone (an in-place op on a leaf, a higher-order op): the analytic
            # model prices it; the count is reported in the plan's notes
            return None

    def _gemm_shard(self, node: OpNode, timing: OpTiming, mbs: int, shard: int, split_dim: str
                    ) -> tuple[float, float]:
        from ..cost_model.compute import scaled_gemm

        scale = mbs / self.graph.batch_size if node.batch_dependent else 1.0
        full = self._gemm(scaled_gemm(node.gemm, scale, split_dim, 1))
        part = self._gemm(scaled_gemm(node.gemm, scale, split_dim, shard))
        fwd = timing.fwd_seconds * part.fwd_seconds / full.fwd_seconds
        bwd = timing.bwd_seconds * part.bwd_seconds / full.bwd_seconds if timing.bwd_seconds else 0.0
        return fwd, bwd

    def _gemm(self, gemm: Gemm) -> OpTiming:
        key = f"gemm {self.dtype_name} b{gemm.batch} m{gemm.m} n{gemm.n} k{gemm.k}"
        if key not in self._gemms:
            record = self.db.get(self.device_name, "ops", key)
            if record is None:
                with torch_threads(self.threads):
                    timing = time_gemm(gemm, self.dtype, self.device, self.warmup, self.repeats)
                self.db.put(self.device_name, "ops", key, timing.to_record())
                self.db.save()
            else:
                timing = OpTiming(record["fwd_seconds"], record["bwd_seconds"])
            self._gemms[key] = timing
        return self._gemms[key]
