"""Configuration dataclasses: one point of the parallel search space, and the precision policy.

Both are frozen, keyword-only and validated on construction; a bad value raises
:class:`autopar.ConfigError` (also a ``ValueError``) naming the field, the value and
the allowed range.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Mapping, Sequence

from .errors import ConfigError


def is_cpu_device(device_name: str) -> bool:
    """A CPU device name: the "cpu" preset, or a measured "cpu <model> xN thread(s)" (profiler)."""
    return device_name.split(" ")[0] == "cpu"

Schedule = Literal["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"]
Recompute = Literal["none", "selective", "op", "full"]
DType = Literal["fp64", "fp32", "bf16", "fp16"]
Compute = Literal["fp64", "fp32", "bf16", "fp16", "fp8"]
Kernels = Literal["eager", "fused", "compiled"]
Offload = Literal["none", "optimizer", "all"]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev")
SPLIT_BACKWARD: tuple[str, ...] = ("zbh1", "zbv", "dualpipev")
"""The zero-bubble schedules (Qi et al., ICLR 2024; DualPipeV): backwards split into an input-gradient pass
("I", sent on at once) and a weight-gradient pass ("W", deferred into what would be bubble). ZB-H1 and ZB-V
split every backward; DualPipeV only those of its warm-up and drain (its steady F&B pairs run whole ones)."""
SPLIT_EVERY_BACKWARD: tuple[str, ...] = ("zbh1", "zbv")
"""The schedules splitting every backward, so that a recomputed forward reruns twice per micro-batch."""
V_SHAPED: tuple[str, ...] = ("zbv", "dualpipev")
"""The schedules placing two chunks on each pipeline device as a V: chunks ``d`` and ``2 pp - 1 - d`` on ``d``."""
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "op", "full")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "all")
"""What ParallelConfig.offload keeps in host memory (cost_model/offload.py)."""
DTYPE_BYTES: Mapping[str, int] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
# a dtype name as Precision writes it -> torch's (torch.<name>), and back
TORCH_DTYPE_NAMES: Mapping[str, str] = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FP8_STORAGES: tuple[str, ...] = ("bf16", "fp16", "fp32")   # Precision.fp8_storage: what torchao's float8 runs over
PRECISION_DTYPES: Mapping[str, str] = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
KERNELS: tuple[str, ...] = ("eager", "fused", "compiled")
GRAD_ACCUMULATIONS: tuple[str, ...] = ("autograd", "fused")   # Precision.grad_accumulation
PARAM_GATHERS: tuple[str, ...] = ("after_step", "overlapped")   # Precision.param_gather
GRAD_REDUCES: tuple[str, ...] = ("reduce_scatter", "all_reduce")   # Precision.grad_reduce
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
"""Precision(compute="fp8")'s scaling recipes: torchao's three float8 training recipes (Float8LinearRecipeName)
and MXFP8 block scaling (32-element blocks, Blackwell and MI355X tensor cores); cost_model/low_precision.py."""
DEFAULT_TIE_TOLERANCE = 0.01
"""plan()'s default tie tolerance: plans within 1% of the fastest are ties (solver/choice.py's rule)."""


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool) in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={value} is out of range: it must be {bound}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One point in the parallel search space.

    The device count is ``dp * cp * tp * pp``. Mesh axes are laid out with ``tp``
    innermost (consecutive ranks, inside a node when it fits), then ``cp``, then ``dp``,
    then ``pp`` outermost, as Megatron-Core does. Expert parallelism does not add devices:
    the ``ep`` ranks holding different experts are ``ep`` consecutive data-parallel replicas
    (Megatron-Core's expert mesh ``tp x cp x ep x dp/ep x pp``).
    """

    dp: int = 1
    """Data-parallel degree: replicas that each take ``1/dp`` of the global batch."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split inside each layer)."""
    pp: int = 1
    """Pipeline-parallel degree: number of pipeline stages (devices along the pipeline)."""
    cp: int = 1
    """Context-parallel degree: each sequence split across ``cp`` ranks (2 cp chunks, head-tail for
    causal balance), attention exchanging keys and values around a ring."""
    ep: int = 1
    """Expert-parallel degree: each mixture-of-experts layer's experts split across ``ep`` data-parallel
    replicas, tokens dispatched to them and combined back by all-to-all. Divides ``dp``."""
    micro_batch_size: int = 1
    """Samples per micro-batch, per data-parallel replica."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b", "interleaved" (1F1B with virtual stages, Megatron-LM's), or the
    zero-bubble ones torch.distributed.pipelining runs: "zbh1" (ZB-H1: 1F1B's order with each backward
    split into an input-gradient and a weight-gradient pass, the weight passes deferred into the
    drain's bubble; every device holds 1F1B's first device's ``pp`` passes) and "zbv" (ZB-V: two
    chunks per device placed as a V, chunk ``d`` and ``2 pp - 1 - d`` on device ``d``, so that the
    last device runs the turn; needs ``virtual_stages=2``) and "dualpipev" (DeepSeek's DualPipeV as
    torch.distributed.pipelining runs it: ZB-V's V, steady pairs of one chunk's forward and the other's
    whole backward, split backwards in the warm-up and drain; needs ``virtual_stages=2`` and at least
    ``2 pp`` micro-batches). The zero-bubble schedules need ``zero <= 1``."""
    virtual_stages: int = 1
    """Model chunks per pipeline device; > 1 only with schedule="interleaved" (any), "zbv" or "dualpipev" (2)."""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP full shard)."""
    offload: Offload = "none"
    """What lives in host memory rather than on the device (cost_model/offload.py): "none"; "optimizer"
    (the optimizer states, with fp32 master weights under mixed precision, and the step on the CPU: each
    rank copies its gradient shard to the host after backward, steps there and copies the updated weights
    back; any ZeRO stage, as DeepSpeed's ``offload_optimizer`` and Megatron-LM's
    ``--optimizer-cpu-offload``); "all" (with ``zero=3``: the shards of the parameters and their gradients
    too, crossing the host link before each all-gather and after each reduce-scatter: FSDP2's
    ``CPUOffloadPolicy``, DeepSpeed's ``offload_param`` with ``offload_optimizer``)."""
    recompute: Recompute = "none"
    """Activation recomputation: "none"; "selective" (the attention core, Korthikanti et al.); "op" (per op, as
    torchtitan's ``selective_ac_option = "op"``: keep every second matrix product's output and fused
    attention's, recompute the rest; runtime/recompute.py); or "full" (the whole layer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: shard the non-tensor-parallel regions along the sequence."""
    stage_recompute: tuple[str, ...] = ()
    """Recompute mode per pipeline stage (length ``pp``), overriding ``recompute``; empty: ``recompute``
    everywhere. The first stages of a 1F1B pipeline hold the most micro-batches, so they may
    recompute while the last ones do not."""
    recompute_layers: int = 0
    """With ``recompute="full"``: recompute only the first ``recompute_layers`` blocks of each model
    chunk and keep the activations of the rest (Megatron-LM's ``--recompute-method block
    --recompute-num-layers``, which counts transformer layers: the embedding and the head, never
    recomputed beside repeated blocks, are not counted); 0: every block. Between no recomputation
    and full, for memory that holds some layers' activations but not all."""

    def __post_init__(self) -> None:
        if isinstance(self.stage_recompute, list):
            object.__setattr__(self, "stage_recompute", tuple(self.stage_recompute))
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "virtual_stages"):
            check_int(name, getattr(self, name), 1)
        check_int("recompute_layers", self.recompute_layers, 0)
        if self.recompute_layers and (self.recompute != "full" or self.stage_recompute):
            raise ConfigError(f"recompute_layers={self.recompute_layers} recomputes part of each chunk in full: it "
                              "needs recompute='full' and no stage_recompute (or recompute_layers=0)")
        check_int("zero", self.zero, 0, 3)
        if isinstance(self.offload, bool):
            raise ConfigError(f"offload takes one of {OFFLOADS}, not {self.offload!r}: \"all\" keeps ZeRO-3's "
                              "parameter, gradient and optimizer shards in host memory, \"optimizer\" the optimizer's "
                              "states alone")
        check_choice("offload", self.offload, OFFLOADS)
        if self.offload == "all" and self.zero != 3:
            raise ConfigError(f"offload='all' keeps ZeRO-3's shards in host memory: it needs zero=3 (got zero={self.zero}); "
                              "set zero=3, or offload='optimizer' (the optimizer states alone, any ZeRO stage)")
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            raise ConfigError(f"schedule={self.schedule!r} places two chunks on each device as a V: it needs "
                              f"virtual_stages=2 (got {self.virtual_stages})")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", *V_SHAPED):
            raise ConfigError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved' "
                f"(got {self.schedule!r}): set schedule='interleaved' or virtual_stages=1")
        if self.schedule in ("interleaved", *SPLIT_BACKWARD) and self.pp == 1:
            raise ConfigError(f"schedule={self.schedule!r} needs pp > 1: raise pp or use schedule='1f1b'")
        if self.schedule in SPLIT_BACKWARD and "op" in (self.recompute, *self.stage_recompute):
            raise ConfigError(f"schedule={self.schedule!r} runs each backward in two passes, and per-op recomputation "
                              "(torch's selective checkpoint) allows one: use recompute='full' or 'selective', or "
                              "schedule='1f1b' or 'interleaved'")
        if self.schedule in SPLIT_BACKWARD and self.zero > 1:
            raise ConfigError(f"schedule={self.schedule!r} splits each backward into an input- and a weight-gradient "
                              f"pass, which ZeRO-{self.zero}'s per-backward reduce-scatter (FSDP2) does not follow: "
                              "use zero=0 or 1, or schedule='1f1b'")
        if self.dp % self.ep:
            raise ConfigError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism splits the experts over "
                              "data-parallel replicas; raise dp to a multiple of ep or lower ep")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1: raise tp or turn sequence_parallel off")
        if not isinstance(self.stage_recompute, tuple):
            raise ConfigError(f"stage_recompute must be a tuple of recompute modes, got {self.stage_recompute!r}")
        if self.stage_recompute:
            if len(self.stage_recompute) != self.pp:
                raise ConfigError(f"stage_recompute has {len(self.stage_recompute)} entries but pp={self.pp}: give "
                                  "one mode per pipeline stage, or leave it empty to use recompute everywhere")
            for i, mode in enumerate(self.stage_recompute):
                check_choice(f"stage_recompute[{i}]", mode, RECOMPUTE_MODES)
            if self.virtual_stages > 1:
                raise ConfigError("stage_recompute needs a non-interleaved schedule (an interleaved device holds "
                                  "chunks from every part of the model): use recompute= instead")

    @property
    def v_shaped(self) -> bool:
        """Whether the schedule places each device's two chunks as a V (:data:`V_SHAPED`)."""
        return self.schedule in V_SHAPED

    def device_chunks(self, device: int) -> tuple[int, ...]:
        """The model chunks (of ``pp * virtual_stages``, in model order) pipeline device ``device`` holds, in
        model order: its local chunks 0, 1, ... Looped (every schedule but the V-shaped ones): ``device,
        device + pp, ...``; "zbv" and "dualpipev" (a V): ``device`` and ``2 pp - 1 - device``."""
        if self.v_shaped:
            return (device, 2 * self.pp - 1 - device)
        return tuple(range(device, self.pp * self.virtual_stages, self.pp))

    def chunk_device(self, chunk: int) -> int:
        """The pipeline device holding model chunk ``chunk`` (:meth:`device_chunks`' inverse)."""
        if self.v_shaped and chunk >= self.pp:
            return 2 * self.pp - 1 - chunk
        return chunk % self.pp

    def stage_mode(self, stage: int) -> str:
        """The recompute mode of pipeline stage ``stage`` (with ``recompute_layers``, of its first blocks
        in each chunk: :meth:`chunk_modes`)."""
        return self.stage_recompute[stage] if self.stage_recompute else self.recompute

    def chunk_modes(self, stage: int, recomputable: Sequence[bool]) -> tuple[str, ...]:
        """The recompute mode of each layer of a model chunk on stage ``stage``, ``recomputable`` telling
        which of them recomputation applies to (OpGraph.recomputable: not the embedding or the head
        beside repeated blocks, "none" here): the stage's mode, and with ``recompute_layers = k``
        only for the chunk's first ``k`` recomputable layers (Megatron's ``--recompute-num-layers``
        counts transformer layers)."""
        mode, out, counted = self.stage_mode(stage), [], 0
        for ok in recomputable:
            counted += ok
            out.append(mode if ok and not (self.recompute_layers and counted > self.recompute_layers) else "none")
        return tuple(out)

    @property
    def devices(self) -> int:
        """Number of devices the configuration occupies (dp * cp * tp * pp)."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_replicas(self) -> int:
        """Ranks that hold the same dense weights and reduce their gradients: the data- and
        context-parallel ranks (``dp * cp``; ZeRO shards over them, as Megatron-Core's distributed
        optimizer does)."""
        return self.dp * self.cp

    def zero_shard(self, params, experts=0.0):
        """Parameters of a rank's ZeRO shard of ``params`` (``experts`` of them expert weights): the dense ones
        over the ``grad_replicas``, the experts over the ``expert_replicas``. Floats or numpy arrays."""
        return (params - experts) / self.grad_replicas + experts / self.expert_replicas

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (``dp * cp / ep``): the expert weights' gradient and ZeRO group."""
        return self.dp * self.cp // self.ep

    @property
    def shares_losses(self) -> bool:
        """Whether the step's losses are all-reduced so that every rank holds them: not when every rank
        computes every loss already (tensor parallelism alone: its ranks end with the same loss). The
        runtime (runtime/losses.py, run by parallelize's Program and the standalone train.py) and the
        cost model (StepTail.loss_share_time) both read this."""
        return not self.dp == self.pp == self.cp == 1

    @property
    def losses_ride_gradients(self) -> bool:
        """Whether the step's shared losses go in the data-parallel gradients' all-reduce rather than in
        one of their own: when that all-reduce spans every rank (data and context parallelism alone,
        ZeRO 0 or 1: the runtime's buckets) and its gradients are the losses' fp32 (the runtime checks
        the dtype: GradReducer.carry). The runtime (runtime/losses.py) and the cost model
        (StepTail.loss_share_time, which checks ``Precision.grads``) read this."""
        return self.shares_losses and self.tp == self.pp == 1 and self.zero < 2

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage_recompute"] = list(self.stage_recompute)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown ParallelConfig field(s) {unknown}; known fields: {sorted(known)}")
        data = dict(data)
        if "stage_recompute" in data:
            data["stage_recompute"] = tuple(data["stage_recompute"])
        if isinstance(data.get("offload"), bool):   # plan files written before "optimizer": true was ZeRO-3's all
            data["offload"] = "all" if data["offload"] else "none"
        return cls(**data)

    def short(self) -> str:
        """A one-line description, e.g. ``dp=32 tp=8 pp=8 mb=1 interleaved(v=2) zero=0 recompute=full``
        (``cp=`` and ``ep=`` appear when above 1)."""
        sched = self.schedule if self.virtual_stages == 1 else f"{self.schedule}(v={self.virtual_stages})"
        sp = " sp" if self.sequence_parallel else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        rec = f"[{','.join(self.stage_recompute)}]" if self.stage_recompute else self.recompute
        if self.recompute_layers:
            rec += f"({self.recompute_layers} layers per chunk)"
        return (f"dp={self.dp}{ep} tp={self.tp}{sp}{cp} pp={self.pp} mb={self.micro_batch_size} {sched} "
                f"zero={self.zero}{'' if self.offload == 'none' else ' offload=' + self.offload} recompute={rec}")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Numerics policy: the bytes each parameter costs, and the kernels the ops run as.

    The default is bf16 mixed precision with fp32 master weights and Adam, i.e.
    2 (weights) + 2 (gradients) + 12 (fp32 master, momentum, variance) = 16 bytes
    per parameter, as in the ZeRO paper. Megatron-LM's non-distributed optimizer
    keeps fp32 gradients ("main grads"): ``Precision(grads="fp32")``, 18 bytes.
    """

    compute: Compute = "bf16"
    """Dtype of weights used in compute and of activations ("fp64": float64 throughout, priced at the device's
    fp64 peak, for checking a program's numerics against one device; no exported stack trains in it); "fp8": the
    linear layers' GEMMs run in fp8
    under ``recipe`` (their inputs, weights and output gradients cast to fp8 around each GEMM), the weights,
    activations and every other op in ``fp8_storage`` (bf16 by default), as torchao's float8 training and
    Transformer Engine do."""
    grads: DType | None = None
    """Dtype gradients are accumulated and reduced in; default: the weights' (``storage``), as autograd accumulates
    them and autopar's programs reduce them (Megatron-LM's fp32 main gradients of bf16 weights: "fp32")."""
    master_weights: bool = True
    """Keep an fp32 master copy of the weights (only meaningful when compute is 16-bit)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam keeps two fp32 states per parameter (momentum, variance); SGD with momentum one."""
    recipe: str | None = None
    """How fp8 GEMM operands are scaled (``compute="fp8"`` only; default "tensorwise"): one of FP8_RECIPES."""
    fp8_storage: DType = "bf16"
    """Under ``compute="fp8"``: the dtype the weights, the activations and every op but the fp8 GEMMs are in
    ("bf16": torchao's float8 training over a bf16 model and Transformer Engine under bf16; "fp32": torchao's
    float8 training over a model left in fp32). The programs check the model's weights against it."""
    kernels: Kernels = "eager"
    """How the ops run, which decides the bytes they move and keep for backward: "eager" (PyTorch
    eager, what ``parallelize`` runs: one kernel per op, autograd keeping what each op's backward
    reads); "fused" (element-wise chains as single kernels that keep their inputs and recompute the rest
    in backward, the ops around them keeping what autograd keeps: Megatron-LM's and Apex's hand-written
    fused kernels, whose activations Korthikanti et al. count; capture/fusion.py); "compiled" (torch.compile: fused chains that keep only a minimum cut of each layer's
    values and recompute the rest inside the backward kernels; capture/fusion.py). Not searched:
    it is how the program is built, as the dtypes are."""
    fused_softmax: bool = True
    """With ``kernels="fused"``: whether the attention's scale, mask and softmax run as Megatron-LM's fused
    scale-mask-softmax kernel (True), or as the PyTorch code Megatron falls back to where that kernel's shape
    constraints fail (False: the scores cast to fp32, scaled, masked, softmaxed and cast back, five kernels with
    fp32 in between; cost_model/compute.py). Megatron checks the constraints each call, so what ran depends on
    the shapes and the version: Megatron-DeepSpeed from October 2021 to March 2022 passed the kernel's arguments
    in the wrong order and fell back wherever micro-batch x heads per tensor-parallel rank was not a multiple of
    the block the heads count gave (e.g. 64 heads at tp=8 with micro-batches of 1 and 2). Not searched."""
    grad_accumulation: str | None = None
    """How the weight gradients of a step's micro-batches add up: "autograd" (each micro-batch after the first
    adds its gradient into the accumulated one, a pass over the device's gradients: PyTorch's AccumulateGrad, what
    ``parallelize``, torchtitan, DeepSpeed and Megatron-DeepSpeed run); "fused" (the weight-gradient GEMM
    accumulates into the gradient buffer in place: Megatron-LM's and Megatron-Core's gradient-accumulation
    fusion, on by default there). Default: "fused" with ``kernels="fused"``, "autograd" otherwise."""

    param_gather: str = "after_step"
    """When ZeRO-1's data-parallel ranks receive each other's updated weights: "after_step" (gathered, or broadcast
    from the ranks that stepped them, once the optimizer has stepped, with nothing left to hide it: what ``parallelize``,
    DeepSpeed's ZeRO-1/2 and Megatron-Core by default run); "overlapped" (bucket by bucket under the next step's
    forward: Megatron-Core's ``--overlap-param-gather``, which the Megatron-LM export then writes). Only ZeRO-1 has
    such a gather: ZeRO-2/3 gather weights before each use, inside the step."""

    grad_reduce: str = "reduce_scatter"
    """How ZeRO-1's data-parallel ranks reduce the gradients: "reduce_scatter" (each rank receives the sum of its
    own shard: what ``parallelize``, Megatron-Core's distributed optimizer and DeepSpeed from 0.13 run); "all_reduce"
    (every rank receives the whole sum and keeps its shard, twice the bytes: DeepSpeed 0.4.4 to 0.12's ZeRO stage 1,
    whose engine turns ``contiguous_gradients`` off at stage 1, so that its optimizer reduces through
    ``buffered_reduce_fallback``'s all-reduce). Only ZeRO-1 reads it: ZeRO-0 all-reduces, ZeRO-2/3 reduce-scatter."""

    def __post_init__(self) -> None:
        if self.grad_accumulation is None:
            object.__setattr__(self, "grad_accumulation", "fused" if self.kernels == "fused" else "autograd")
        check_choice("grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATIONS)
        check_choice("param_gather", self.param_gather, PARAM_GATHERS)
        check_choice("grad_reduce", self.grad_reduce, GRAD_REDUCES)
        check_choice("compute", self.compute, (*DTYPE_BYTES, "fp8"))
        check_choice("fp8_storage", self.fp8_storage, FP8_STORAGES)
        if self.grads is None:
            object.__setattr__(self, "grads", self.storage)
        check_choice("grads", self.grads, tuple(DTYPE_BYTES))
        if self.compute == "fp8":
            if self.recipe is None:
                object.__setattr__(self, "recipe", "tensorwise")
            check_choice("recipe", self.recipe, FP8_RECIPES)
        elif self.recipe is not None:
            raise ConfigError(f"Precision(recipe={self.recipe!r}) scales fp8 GEMM operands, but compute="
                              f"{self.compute!r}: pass compute=\"fp8\" with it, or drop recipe")
        if self.compute != "fp8" and self.fp8_storage != "bf16":
            raise ConfigError(f"Precision(fp8_storage={self.fp8_storage!r}) is the dtype around fp8 GEMMs, but compute="
                              f"{self.compute!r}: pass compute=\"fp8\" with it, or drop fp8_storage (compute is "
                              "then the weights' and activations' dtype)")
        check_choice("optimizer", self.optimizer, ("adam", "sgd"))
        check_choice("kernels", self.kernels, KERNELS)
        if not isinstance(self.fused_softmax, bool):
            raise ConfigError(f"Precision(fused_softmax={self.fused_softmax!r}) must be True or False")
        if not self.fused_softmax and self.kernels != "fused":
            raise ConfigError(f"Precision(fused_softmax=False) prices Megatron-LM's PyTorch fallback of its fused "
                              f"scale-mask-softmax kernel, but kernels={self.kernels!r} runs no such kernel: pass "
                              "kernels=\"fused\" with it, or drop fused_softmax")

    @property
    def kernels_name(self) -> str:
        """``kernels``, and how the attention softmax ran where it was not the fused kernel (reports)."""
        return self.kernels if self.fused_softmax else f"{self.kernels} (PyTorch softmax)"

    @property
    def storage(self) -> str:
        """The dtype weights and activations are kept in: ``compute``, or ``fp8_storage`` for fp8 compute."""
        return self.fp8_storage if self.compute == "fp8" else self.compute

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.storage]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grads]

    @property
    def master_bytes(self) -> int:
        """The fp32 master copy per parameter kept beside 16-bit weights (0: none, the weights are stepped)."""
        return 4 if (self.master_weights and DTYPE_BYTES[self.storage] < 4) else 0

    @property
    def moment_bytes(self) -> int:
        """The optimizer's own fp32 states per parameter: Adam's two moments, SGD's momentum."""
        return 8 if self.optimizer == "adam" else 4

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state per parameter: fp32 master (if kept) plus the optimizer's fp32 states."""
        return self.master_bytes + self.moment_bytes

    @property
    def activation_bytes(self) -> int:
        return DTYPE_BYTES[self.storage]

    def gathers_fp8(self, cfg: ParallelConfig) -> bool:
        """Whether FSDP2 gathers the fp8 linear layers' weights in fp8 (torchao's
        ``enable_fsdp_float8_all_gather``): a tensor-wise fp8 plan at ZeRO 2-3 over replicas without tensor
        parallelism. Each rank casts its shard with the scale of the whole weight (every such weight's amax over
        its shards, all in one all-reduce a step: torchao's ``precompute_float8_dynamic_scale_for_fsdp``) and
        gathers one byte a parameter where a bf16 gather moves two; the forward and the input gradient take the gathered fp8
        weight as they would cast it. Row-wise and block scales are cast after the gather (torchao supports
        the fp8 gather for tensor-wise scales only), and so is a tensor-parallel shard's (not run here)."""
        return (self.compute == "fp8" and self.recipe == "tensorwise" and cfg.zero >= 2 and cfg.tp == 1
                and cfg.grad_replicas > 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_device(cls, device_name: str) -> "Precision":
        """The default policy for a device: fp32 on CPUs, bf16 mixed precision elsewhere."""
        return cls(compute="fp32", grads="fp32") if is_cpu_device(device_name) else cls()
