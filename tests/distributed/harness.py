"""Run many parallelize cases in one spawn of gloo ranks, against single-process references.

The parent plans each case (autopar.plan with every ParallelConfig field pinned, or free) and
hands it to the session's world of ``world`` ranks (worlds.py) at once, so the ranks run a case
while the parent plans the next; then it computes the single-process reference (loss and
gradients of step 1, parameters after two AdamW steps on two batches) to compare every rank's
results with. Two steps, not more: the second is the first to read the optimizer state a step left
(sharded with ZeRO, split with tensor parallelism); a third runs no code the second did not.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 2
LR = 1e-3
# AdamW's eps, above the default 1e-8: AdamW divides each element's update by its gradient's
# magnitude, so an element whose true gradient is zero (an attention key's bias: softmax ignores a
# shift shared by a row; a ReLU unit dead on the whole batch) moves by up to lr on rounding noise
# alone (1e-9 to 1e-7 here), noise that differs between one process and 2 ranks: with eps=1e-8 AdamW is
# lr/eps = 1e5-Lipschitz in the gradient, so gradients that agree to 1e-9 (CTRL at tp=2; fuzz seeds
# 110 and 191) end up to 6e-4 apart after a few steps, far outside the parameter tolerance. With
# eps=1e-4 such noise moves a parameter by at most lr * 1e-7 / eps = 1e-6, and gradients above
# ~1e-3 (nearly all) keep AdamW's normalised update.
EPS = 1e-4


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer every comparison with one process uses (both sides), but the cases that name another."""
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def adafactor(params) -> torch.optim.Optimizer:
    """Adafactor (T5's optimizer, transformers'): its second moment of a matrix is factored into row and column
    means, and its update clipped by the update's RMS over the tensor, so it is not element-wise (runtime/optim.py).
    Muon is not either, but orthogonalising a gradient of low rank (these tests' batches) turns rounding noise
    into steps: no comparison between two runs of it holds to a tolerance."""
    from transformers.optimization import Adafactor
    return Adafactor(params, lr=LR, relative_step=False, scale_parameter=False, warmup_init=False)


def sgd(params) -> torch.optim.Optimizer:
    """Plain SGD: a step proportional to the gradient, so a wrong clipping factor shows in the parameters
    (AdamW's step all but ignores a gradient's scale)."""
    return torch.optim.SGD(params, lr=LR * 100)


OPTIMIZERS = {"adamw": adamw, "adafactor": adafactor, "sgd": sgd}


@dataclass(frozen=True)
class Case:
    name: str
    model: str                    # key of MODELS
    fixed: dict | None            # ParallelConfig fields pinned; None: the planner's free choice
    world: int
    global_batch: int = 4
    edit: dict | None = None      # a hand-edited plan: the planned config with these fields replaced
    compile: str | None = None    # parallelize(compile=): a torch.compile backend for every layer's code
    example_batch: int = 1        # rows of the example inputs the plan is made from (as users pass them)
    steps: int = STEPS            # AdamW steps compared (a compiled program compiles its optimizer's step at
    #                               its second: one step leaves that to the cases that test it)
    precision: dict | None = None  # Precision fields the plan is edited to (fp8: the reference converted alike)
    optimizer: str = "adamw"       # key of OPTIMIZERS, on both sides
    clip: float | None = None      # max_grad_norm: the gradients clipped to this total norm before every step
    decay: float | None = None     # a LambdaLR on the program's optimizer: the rate times decay ** step


def _mlp():
    from autopar.models.mlp import MLP
    torch.manual_seed(0)
    model = MLP(in_features=16, hidden=1024, out_features=8, depth=4)  # wide enough that tp=2 splits it
    return model


def mlp_loss(out, inputs):
    return torch.nn.functional.mse_loss(out, torch.zeros_like(out) + 0.5)


def _gpt(device: str = "cpu", layers: int = 4):
    from autopar.models import GPTConfig, build_gpt
    torch.manual_seed(0)
    model, _ = build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=layers, seq_len=8, dropout=0.0),
                         batch_size=1, device=device)
    return model


def _gpt_sdpa(layers: int = 4):
    """The GPT with fused attention (F.scaled_dot_product_attention): what context parallelism splits."""
    from autopar.models import GPTConfig, build_gpt
    torch.manual_seed(0)
    model, _ = build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=layers, seq_len=8, dropout=0.0,
                                   attention="sdpa"), batch_size=1)
    return model


def _hf(builder, **sizes):
    def make():
        import autopar.models.hf as hf
        torch.manual_seed(0)
        model, _ = getattr(hf, builder)(**{**dict(layers=4, hidden=32, heads=4, vocab=64, seq_len=8, dropout=0.0,
                                                  batch_size=1), **sizes})
        return model.float()
    return make


def _moe(capacity_factor: float | None = None):
    """The hand-written Mixtral (autopar.models.moe), tiny, by default dropping nothing
    (``capacity_factor=None``: with a capacity the tokens an expert drops depend on how the batch is split)."""
    def make():
        import dataclasses
        from autopar.models import Mixtral
        from autopar.models.registry import spec
        torch.manual_seed(0)
        return Mixtral(dataclasses.replace(spec("mixtral-tiny").config, vocab_size=64, seq_len=8, layers=2,
                                           capacity_factor=capacity_factor))
    return make


def _cnn():
    from autopar.models.cnn import build_resnet
    torch.manual_seed(0)
    return build_resnet("small", batch_size=1, image_size=16)[0]


class CrossAttention(torch.nn.Module):
    """Decoder tokens (8) attending causally to themselves, then to memory tokens (4): SDPA with a
    query length other than the key length, as an encoder-decoder's cross attention has. No biases on
    the projections: a key bias has an exactly zero gradient (softmax ignores a score shift shared by
    a row), so its computed gradient is rounding noise that AdamW would scale up to lr-sized steps."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.memory = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, h = t.shape
        return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def _attend(self, q, k, v) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(self._split(q), self._split(k), self._split(v),
                                                               is_causal=True)
        return out.transpose(1, 2).flatten(2)

    def forward(self, input_ids, memory_ids, labels):
        x, m = self.embed(input_ids), self.memory(memory_ids)
        x = x + self._attend(*self.qkv(x).chunk(3, dim=-1))
        x = x + self._attend(self.q(x), *self.kv(m).chunk(2, dim=-1))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _xattn():
    torch.manual_seed(0)
    return CrossAttention()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mlp": _mlp, "gpt": _gpt, "llama": _hf("build_hf_llama"), "gpt2": _hf("build_hf_gpt2"),
    "bert": _hf("build_hf_bert"), "cnn": _cnn, "gpt-sdpa": _gpt_sdpa,
    "mixtral": _hf("build_hf_mixtral", layers=2, ffn_hidden=64, num_experts=4, top_k=2), "moe": _moe(),
    "moe-capacity": _moe(1.0), "xattn": _xattn,
    # two blocks, for the torch.compile cases: compiling costs time in proportion to the ops traced
    "gpt-2l": lambda: _gpt(layers=2), "gpt-sdpa-2l": lambda: _gpt_sdpa(layers=2),
}
# Built on the meta device: parallelize materialises each rank's shards, and the single-process
# reference is autopar.init_weights of the same meta model (runtime/sharded_init.py).
def _on_meta(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return make()
    return build


MODELS.update({"gpt-meta": lambda: _gpt("meta"), "llama-meta": _hf("build_hf_llama", device="meta"),
               "moe-meta": _on_meta(_moe())})


_PRISTINE: dict[str, torch.nn.Module] = {}


def fresh(name: str) -> torch.nn.Module:
    """A new ``MODELS[name]()``: a deep copy of one built once per process (building, Hugging Face's
    init above all, costs more than a tiny model's run), with the global generator seeded as the
    builders seed it."""
    if name not in _PRISTINE:
        _PRISTINE[name] = MODELS[name]()
    torch.manual_seed(0)
    return copy.deepcopy(_PRISTINE[name])


def batches(model_name: str, n: int, global_batch: int) -> list[Any]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        if model_name == "mlp":
            out.append((torch.randn(global_batch, 16, generator=g),))
        elif model_name == "cnn":
            out.append((torch.randn(global_batch, 3, 16, 16, generator=g),))
        else:
            ids = torch.randint(0, 64, (global_batch, 8), generator=g)
            batch = {"input_ids": ids, "labels": torch.randint(0, 64, (global_batch, 8), generator=g)}
            if model_name == "bert":
                batch["attention_mask"] = torch.ones_like(ids)
            if model_name == "xattn":
                batch = {"input_ids": ids, "memory_ids": torch.randint(0, 64, (global_batch, 4), generator=g),
                         "labels": batch["labels"]}
            out.append(batch)
    return out


def cnn_loss(out, inputs):
    return out.float().pow(2).mean()


def loss_fn_of(model_name: str):
    return {"mlp": mlp_loss, "cnn": cnn_loss}.get(model_name)


def call_loss(model, batch, loss_fn):
    from autopar.capture.export import LossWrapper
    from autopar.capture.export import normalize_inputs
    args, kwargs = normalize_inputs(batch)
    return LossWrapper(model, loss_fn, batch)(*args, **kwargs)


def one_process(model: torch.nn.Module, data: list[Any], step_loss: Callable[[Any], torch.Tensor],
                optimizer: Callable[[Any], torch.optim.Optimizer] = adamw, clip: float | None = None,
                decay: float | None = None) -> dict[str, Any]:
    """The single-process reference: the loss and gradients of ``step_loss(data[0])`` (a parameter no
    op of the loss reads gets a zero gradient, as the programs report it), and the parameters after
    one ``optimizer`` step per batch of ``data``; with ``clip``, each step's gradients clipped to that total
    norm first (torch.nn.utils.clip_grad_norm_), and the first step's norm and clipped gradients; with
    ``decay``, the learning rate scheduled to decay ** step (LambdaLR, stepped after each step)."""
    def all_grads() -> dict[str, torch.Tensor]:
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in model.named_parameters()}

    loss = step_loss(data[0])
    loss.backward()
    grads = all_grads()
    model.zero_grad()
    opt = optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: decay ** k) if decay is not None else None
    out: dict[str, Any] = {}
    for k, b in enumerate(data):
        opt.zero_grad()
        step_loss(b).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if k == 0:
                out = {"norm": norm.item(), "clipped": all_grads()}
        opt.step()
        if schedule is not None:
            schedule.step()
    return {"loss": loss.item(), "grads": grads, **out,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


_REFERENCES: dict[tuple[str, int, int], dict[str, Any]] = {}


def reference(case: Case) -> dict[str, Any]:
    """The single-process reference of the case's model and global batch (the same for every plan of
    them: computed once)."""
    from autopar import init_weights
    from autopar.runtime.sharded_init import has_meta
    key = (case.model, case.global_batch, case.steps, tuple(sorted((case.precision or {}).items())), case.optimizer,
           case.clip, case.decay)
    if key not in _REFERENCES:
        model = fresh(case.model)
        if has_meta(model):
            init_weights(model)
        if (case.precision or {}).get("compute") == "fp8":
            to_fp8(model, case.precision.get("recipe", "tensorwise"))
        loss_fn = loss_fn_of(case.model)
        _REFERENCES[key] = one_process(model, batches(case.model, case.steps, case.global_batch),
                                       lambda b: call_loss(model, b, loss_fn), OPTIMIZERS[case.optimizer], case.clip,
                                       case.decay)
    return _REFERENCES[key]


def to_fp8(model: torch.nn.Module, recipe: str) -> None:
    """``model`` converted as an fp8 plan runs it: torchao's float8 training (emulated on this CPU) on the
    linear layers ops.runs_in_fp8 names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from autopar.ops import runs_in_fp8
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: runs_in_fp8(
        "linear", type(m).__name__, m.in_features, m.out_features))


def test_cluster(world: int):
    """A CPU node whose links are fast enough that tensor parallelism pays off even for these tiny
    models, so that the planner's layouts (and the pinned tp cases) really split ops."""
    from autopar import Cluster
    return Cluster.from_spec(f"1x{world}xcpu", intra_node_bandwidth=1e12, intra_node_latency=1e-9)


_GRAPHS: dict[str, Any] = {}
_SHARDING: dict[tuple[str, int], Any] = {}


def make_plan(case: Case):
    """autopar.plan for the case, capturing each model once and sharing its sharding ILPs' layouts
    between the cases of a model and world (solve(sharding=): the same plans, each ILP solved once)."""
    from autopar import Precision
    from autopar.capture import capture
    from autopar.runtime.batches import slice_batch
    from autopar.codegen.inputs import with_inputs
    from autopar.solver import solve
    from autopar.solver.sharding_solver import ShardingSolver
    from torch.utils._pytree import tree_map_only
    rows = max(case.global_batch, case.example_batch)
    example = slice_batch(batches(case.model, 1, rows)[0], 0, case.example_batch, rows)
    graph_key = (case.model, case.example_batch)
    if graph_key not in _GRAPHS:
        model = fresh(case.model)
        on = next(model.parameters()).device   # a meta model is planned from meta inputs
        _GRAPHS[graph_key] = capture(model, tree_map_only(torch.Tensor, lambda t: t.to(on), example),
                                     loss_fn_of(case.model))
    cluster = test_cluster(case.world)
    key = (case.model, case.example_batch, case.world)
    if key not in _SHARDING:
        _SHARDING[key] = ShardingSolver(_GRAPHS[graph_key], cluster, Precision.for_device(cluster.device.name))
    plan, _ = solve(_GRAPHS[graph_key], cluster, case.global_batch,
                    fixed=None if case.fixed is None else dict(case.fixed), sharding=_SHARDING[key])
    if case.edit:
        plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, **case.edit))
    if case.precision:   # priced on this CPU (no fp8 peak): the program's numerics are what these cases test
        plan = dataclasses.replace(plan, precision=Precision(**case.precision))
    return with_inputs(plan, example)


_EXPORTS: dict[Any, Any] = {}


@contextlib.contextmanager
def shared_exports(model_key: Any):
    """Within the block, ``parallelize`` on this rank reuses the graph it exported for an earlier case of
    the same model (``model_key``: what builds it, e.g. a MODELS name; every build of one key is the same
    architecture), micro-batch, loss function and mode: a deep copy of that ExportedProgram, since the
    runtime rewrites its copy (devices, materialised buffers). torch.export of a tiny model costs 0.3-0.9 s,
    most of a case's time on a rank; the cases share few distinct exports. Parameter values never come
    from the export (the runtime reads them from the model it is given)."""
    import autopar.driver.assembly as program
    from autopar.codegen.inputs import describe_inputs
    real = program.run_export

    def export(model, inputs, loss_fn=None, train_mode=False):
        device = next((t.device.type for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
        key = (model_key, repr(describe_inputs(inputs)), device, loss_fn, model.training, train_mode)
        if key not in _EXPORTS:
            _EXPORTS[key] = real(model, inputs, loss_fn, train_mode=train_mode)
        with warnings.catch_warnings():   # torch's pytree specs warn about a deprecated class when copied
            warnings.simplefilter("ignore", FutureWarning)
            return copy.deepcopy(_EXPORTS[key])

    program.run_export = export
    try:
        yield
    finally:
        program.run_export = real


def run_case(rank: int, world: int, case: Case, plan_dict: dict) -> dict[str, Any]:
    """One case on one rank of a worlds.World: loss and full gradients of a forward_backward, the
    parameters after ``case.steps`` AdamW steps, the first on those gradients (through a torch.save round trip
    into a fresh model)."""
    import autopar
    from autopar.runtime.data_parallel import local
    torch.autograd.set_detect_anomaly(bool(os.environ.get("AUTOPAR_TEST_ANOMALY")))
    plan = autopar.Plan.from_dict(plan_dict)
    model = fresh(case.model)
    data = batches(case.model, case.steps, case.global_batch)
    with shared_exports(case.model):
        program = autopar.parallelize(model, plan, OPTIMIZERS[case.optimizer], loss_fn=loss_fn_of(case.model),
                                      timeout=60, compile=case.compile or False)
    loss = program.forward_backward(data[0])
    grads = program.full_grads()
    clipped = {}
    if case.clip is not None:   # the first step's clip on its own (after full_grads), the others in train_step
        clipped = {"norm": program.clip_grad_norm_(case.clip).item(), "clipped": program.full_grads()}
    # a learning-rate schedule on the program's optimizer, whatever wraps the user's (ZeRO-1, offload)
    schedule = torch.optim.lr_scheduler.LambdaLR(program.optimizer, lambda k: case.decay ** k) if case.decay else None
    program.optimizer.step()   # train_step(data[0]) is this forward_backward and this step
    for b in data[1:]:
        if schedule is not None:
            schedule.step()
        program.train_step(b, max_grad_norm=case.clip)
    params = round_trip(program.full_state_dict(), fresh(case.model))
    return {"loss": loss.item(), "grads": grads, "params": params, **clipped,
            "local_numel": sum(local(p).numel() for p in program.parameters())}


def dp_reduction(rank: int, world: int, case: Case, plan_dict: dict) -> dict[str, Any]:
    """A forward_backward's data-parallel gradient reduction on one rank of a worlds.World (ZeRO-0 or 1): the
    elements summed onto this rank and onto the others (each owner's parameters under ZeRO-1), whether this rank
    holds no gradient of the others' parameters until ``full_grads`` shares their means, and, per bucket, how many
    gradients this rank holds and in how many buffers (a bucket's gradients are views of the buffer its
    collective reduced, not copies of it)."""
    import autopar
    from autopar.runtime.data_parallel import local
    plan = autopar.Plan.from_dict(plan_dict)
    model = fresh(case.model)
    with shared_exports(case.model):
        program = autopar.parallelize(model, plan, adamw, loss_fn=loss_fn_of(case.model), timeout=60)
    program.forward_backward(batches(case.model, 1, case.global_batch)[0])
    me = dist.get_rank()
    parts = [(params, dst) for reducer in program.reducers for params, dst in reducer.reduced]   # (params, owner)
    others = [p for params, dst in parts if dst != me for p in params]
    freed = all(p.grad is None for p in others)
    buckets = [(sum(1 for p in b.params if p.grad is not None),
                len({local(p.grad).untyped_storage().data_ptr() for p in b.params if p.grad is not None}))
               for reducer in program.reducers for chunk in reducer.buckets for b in chunk]
    program.full_grads()
    return {"mine": sum(local(p).numel() for params, dst in parts if dst == me for p in params),
            "others": sum(local(p).numel() for p in others), "freed": freed,
            "shared": all(p.grad is not None for p in others), "buckets": buckets}


def held_gradients(rank: int, world: int, case: Case, plan_dict: dict) -> dict[str, Any]:
    """Whether the last step's gradients are all freed when the next step's first forward runs (one rank of a
    worlds.World): none must be held through the next forward and backward beside the new ones, a copy of
    every gradient the plan's memory does not count. A weak reference to each local gradient a parameter or
    the optimizer's local shard held (tensor parallelism steps plain shards: assembly.build_optimizer); the
    bytes of those still alive."""
    import gc
    import weakref
    import autopar
    from autopar.runtime.data_parallel import local
    plan = autopar.Plan.from_dict(plan_dict)
    model = fresh(case.model)
    with shared_exports(case.model):
        program = autopar.parallelize(model, plan, adamw, loss_fn=loss_fn_of(case.model), timeout=60)
    data = batches(case.model, 2, case.global_batch)
    program.train_step(data[0])
    held = {id(local(g)): local(g) for g in [p.grad for p in program.parameters()] +
            [shard.grad for _, shard in program.shards] if g is not None}
    refs = [(weakref.ref(g), g.numel() * g.element_size()) for g in held.values()]
    del held
    alive: list[int] = []

    def count(*_):   # bytes of the last step's gradients still held (cyclic garbage collected first)
        gc.collect()
        alive.append(sum(n for r, n in refs if r() is not None))
    hooks = [chunk.register_forward_pre_hook(count) for chunk in program.chunks.values()]
    program.train_step(data[1])
    for hook in hooks:
        hook.remove()
    return {"bytes": sum(n for _, n in refs), "alive": alive[0] if alive else None, "shards": len(program.shards)}


def thread_count(rank: int, world: int) -> int:
    """This rank's threads (a worlds.World job; Linux): each live gloo process group holds some."""
    return len(os.listdir("/proc/self/task"))


def round_trip(state: dict, fresh: torch.nn.Module) -> dict:
    """``state`` through torch.save / torch.load into a fresh single-device model (strict: every key of
    its state_dict, nothing else); returns that model's parameters."""
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf), strict=True, assign=any(p.is_meta for p in fresh.parameters()))
    return {n: p.detach().clone() for n, p in fresh.named_parameters()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_matches(got: dict, ref: dict, rank: int) -> None:
    """One rank's results against the reference, at test_parallelize.py's tolerances: loss relative
    1e-5, gradients 1e-4 of the largest, parameters after the steps 1e-4."""
    import math
    assert "error" not in got, got.get("error")
    assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5), (rank, got["loss"], ref["loss"])
    largest = max((g.abs().max().item() for g in ref["grads"].values() if g.numel()), default=0.0)
    assert set(got["grads"]) == set(ref["grads"]), ("gradient names", rank, sorted(set(ref["grads"]) - set(got["grads"]))[:3],
                                                    sorted(set(got["grads"]) - set(ref["grads"]))[:3])
    for name, g in ref["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item() if g.numel() else 0.0
        assert diff <= 1e-4 * largest, (rank, name, diff, largest)
    for name, p in ref["params"].items():
        diff = (got["params"][name] - p).abs().max().item() if p.numel() else 0.0
        assert diff <= 1e-4, (rank, name, diff)
    if "norm" in ref:   # clipped: the model's total norm, and every gradient scaled by the one factor
        assert math.isclose(got["norm"], ref["norm"], rel_tol=1e-5), (rank, got["norm"], ref["norm"])
        largest = max((g.abs().max().item() for g in ref["clipped"].values() if g.numel()), default=0.0)
        for name, g in ref["clipped"].items():
            diff = (got["clipped"][name] - g).abs().max().item() if g.numel() else 0.0
            assert diff <= 1e-4 * largest, (rank, "clipped", name, diff, largest)


def run_cases(cases: list[Case], world: int, function: str = "harness:run_case",
              plan: Callable[[Case], Any] | None = None) -> list[dict[str, Any]]:
    """Per rank: case name -> {"loss", "grads", "params"} or {"error"}. Each case goes to the session's
    world (worlds.py) as soon as it is planned, so this process plans the next case while the ranks
    run this one; ``function`` runs a case on a rank, ``plan`` (default make_plan) plans it."""
    import worlds
    w = worlds.world(world)
    jobs = [(c, w.submit(function, c, (plan or make_plan)(c).to_dict())) for c in cases]
    out: list[dict[str, Any]] = [{} for _ in range(world)]
    for case, k in jobs:
        for rank, got in enumerate(w.result(k)):
            out[rank][case.name] = got
    return out


def _failure_worker(rank: int, world: int, port: int, plan_dict: dict, mode: str, out_dir: str) -> None:
    """Rank 1 goes silent (``mode="silent"``: sleeps past the timeout) or dies (``"dead"``) after
    building its program; rank 0 runs a step and records what it raised, and how soon."""
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopar
    plan = autopar.Plan.from_dict(plan_dict)
    model = MODELS["gpt"]()
    out: dict[str, Any] = {}
    for label, bad in (("world", dataclass_replace_devices(plan)), ("fingerprint", plan)):
        try:
            other = model if label == "world" else _other_gpt()
            autopar.parallelize(other, bad, timeout=FAILURE_TIMEOUT)
        except autopar.AutoparError as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    program = autopar.parallelize(model, plan, timeout=FAILURE_TIMEOUT)
    dist.barrier()
    if rank == 1:
        if mode == "silent":
            time.sleep(FAILURE_TIMEOUT + 1.5)
        os._exit(0)
    start = time.perf_counter()
    try:
        program.forward_backward(batches("gpt", 1, 4)[0])
        out["step"] = "no error"
    except autopar.AutoparError as exc:
        out["step"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - start
    torch.save(out, os.path.join(out_dir, "failure.pt"))
    os._exit(0)


FAILURE_TIMEOUT = 3.0


def dataclass_replace_devices(plan):
    """The plan as if made for twice the devices (dp doubled)."""
    import dataclasses
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=plan.config.dp * 2))


def _other_gpt():
    from autopar.models import GPTConfig, build_gpt
    return build_gpt(GPTConfig(vocab_size=64, hidden=48, heads=4, layers=4, seq_len=8, dropout=0.0), batch_size=1)[0]


def _kill_worker(rank: int, world: int, port: int, plan_dict: dict, out_dir: str) -> None:
    """Every rank trains the MLP: step 0 normally, step 1 on a batch whose sample 3 is NaN (every
    rank must refuse the step, naming its micro-batch, with the parameters unchanged), step 2 with
    rank 3 killed by os._exit in the middle of its first backward. The survivors record what they
    raised and how soon; each then exits at once, as a crashed training script would."""
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopar
    program = autopar.parallelize(MODELS["mlp"](), autopar.Plan.from_dict(plan_dict),
                                  adamw, loss_fn=mlp_loss, timeout=FAILURE_TIMEOUT)
    data = batches("mlp", 2, 4)
    out: dict[str, Any] = {"rank": rank}
    program.train_step(data[0])
    before = program.full_state_dict()
    poisoned = (data[1][0].clone(),)
    poisoned[0][3, 5] = float("nan")
    try:
        program.train_step(poisoned)
        out["nan"] = "no error"
    except autopar.AutoparError as exc:
        out["nan"] = f"{type(exc).__name__}: {exc}"
    after = program.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    if rank == 3:
        def die(*args, **kwargs):
            os._exit(1)
        program.runner._backward = die
    start = time.perf_counter()
    try:
        program.train_step(data[1])
        out["kill"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test asserts it is a RuntimeFailure
        out["kill"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - start
    torch.save(out, os.path.join(out_dir, f"kill{rank}.pt"))
    os._exit(0)


def run_kill(plan) -> list[dict[str, Any]]:
    """The survivors' records from _kill_worker on 4 ranks (rank 3 dies and writes none)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_kill_worker, args=(4, free_port(), plan.to_dict(), out), nprocs=4, join=False,
                                 start_method="spawn")
        for process in ctx.processes:   # not ctx.join(): rank 3's exit code 1 is the point, not a failure
            process.join(timeout=120)
        codes = [process.exitcode for process in ctx.processes]
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
        assert codes == [0, 0, 0, 1], f"exit codes {codes}: a survivor crashed or hung (see its stderr)"
        return [torch.load(os.path.join(out, f"kill{r}.pt")) for r in range(3)]


def run_failure(plan, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_failure_worker, args=(2, free_port(), plan.to_dict(), mode, out), nprocs=2, join=True,
                           start_method="spawn")
        return torch.load(os.path.join(out, "failure.pt"))
