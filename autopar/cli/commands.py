"""``autopar plan | estimate | show | compare | codegen | models | demo``: the planner from a shell."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from ..config import DEFAULT_TIE_TOLERANCE
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..plan import Plan
    from .models import LoadedModel

# The parsers below import no torch (`autopar --help` stays fast): each command imports what it runs.


# --- plan / estimate -----------------------------------------------------------------------------
def run_plan(args: argparse.Namespace) -> int:
    import autopar
    from .models import parse_fields
    cluster = _cluster(args)
    loaded = _model(args, cluster)
    fixed = parse_fields(args.fixed, "--fixed") if args.fixed else None
    limits = {} if args.ilp_node_limit is None else {"ilp_node_limit": args.ilp_node_limit or None}
    plan = autopar.plan(loaded.model, cluster, loaded.inputs, global_batch_size=args.global_batch, fixed=fixed,
                        time_limit=args.time_limit, profile=args.profile, verbose=not args.quiet,
                        ilp_time_limit=args.ilp_time_limit, precision=_precision(args, cluster),
                        tie_tolerance=args.tie_tolerance, **limits)
    return _report(_named(plan, loaded), args)


def run_estimate(args: argparse.Namespace) -> int:
    import autopar
    from .models import parse_fields
    cluster = _cluster(args)
    loaded = _model(args, cluster)
    config = autopar.ParallelConfig(**parse_fields(args.config, "--config"))
    plan = autopar.estimate(loaded.model, cluster, loaded.inputs, config, global_batch_size=args.global_batch,
                            profile=args.profile, precision=_precision(args, cluster))
    return _report(_named(plan, loaded), args)


def _precision(args: argparse.Namespace, cluster):
    """The device's default precision, with ``--kernels``; with ``--dtype``, the model's weights, activations and
    gradients in it (the program runs the model in the dtype it is built in, and refuses another plan's)."""
    from ..config import Precision
    precision = dataclasses.replace(Precision.for_device(cluster.device.name), kernels=args.kernels)
    dtype = getattr(args, "dtype", None)
    return dataclasses.replace(precision, compute=dtype, grads=dtype) if dtype else precision


def _cluster(args: argparse.Namespace):
    from ..cluster import Cluster
    memory = None if args.device_memory is None else args.device_memory * 1e9
    if args.cluster == "local":
        cluster = Cluster.local(progress=not args.quiet)
        if memory is None:
            return cluster
        return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory))
    if args.profile:
        raise ConfigError("--profile times ops on this machine: use --cluster local")
    return Cluster.from_spec(args.cluster, device_memory=memory)


def _model(args: argparse.Namespace, cluster) -> LoadedModel:
    from ..config import is_cpu_device
    from .models import load_model
    dtype = args.dtype or ("fp32" if is_cpu_device(cluster.device.name) else "bf16")
    return load_model(args.model, seq_len=args.seq_len, dtype=dtype, device="cpu" if args.profile else "meta")


def _named(plan: Plan, loaded: LoadedModel) -> Plan:
    """The plan under the command's MODEL name, with how to build the model again (for codegen)."""
    return dataclasses.replace(plan, model_name=loaded.name, extra={**plan.extra, "model": dict(loaded.source)})


def _report(plan: Plan, args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        print(plan.to_json())
    else:
        print(plan.summary())
        if getattr(args, "explain", False):
            print()
            print(plan.explain())
    if getattr(args, "output", None):
        plan.save(args.output)
        _note(args, f"plan written to {args.output}")
    for option, method in (("timeline", plan.plot_timeline), ("memory", plan.plot_memory),
                           ("partition", plan.plot_partition)):
        path = getattr(args, option, None)
        if path:
            method(path)
            _note(args, f"{option} chart written to {path}")
    return 0


def _note(args: argparse.Namespace, text: str) -> None:
    if not getattr(args, "json", False):
        print(text)


# --- show / compare ------------------------------------------------------------------------------
def run_show(args: argparse.Namespace) -> int:
    from ..plan import load_plan
    return _report(load_plan(args.plan), args)


def run_compare(args: argparse.Namespace) -> int:
    from ..plan import load_plan
    print(load_plan(args.a).compare(load_plan(args.b)))
    return 0


# --- codegen -------------------------------------------------------------------------------------
MODEL_MODULE = "planned_model"


def run_codegen(args: argparse.Namespace) -> int:
    from ..codegen.emit import SCRIPT, emit, run_hint
    from ..codegen.folder import staged
    from ..plan import load_plan
    plan = load_plan(args.plan)
    factory = args.model_factory
    source = plan.extra.get("model")
    if factory is None and not source:
        raise ConfigError(f"{args.plan} does not say how to build its model (it was not made by `autopar plan`): "
                          "pass --model-factory package.module:function")
    with staged(args.output) as folder:   # OUT gets the files only if every one was written
        if factory is None:
            with open(os.path.join(folder, MODEL_MODULE + ".py"), "w") as fh:
                fh.write(model_module(source))
            factory = f"{MODEL_MODULE}:build"
        # the factory is imported here, to export the model: from OUT as train.py will
        sys.path.insert(0, folder)
        sys.modules.pop(MODEL_MODULE, None)   # this folder's, not one an earlier call imported
        try:
            script = emit(plan, folder, model_factory=factory, batch_factory=args.batch_factory,
                          loss_fn=args.loss_fn, lr=args.lr, standalone=args.standalone)
        finally:
            sys.path.remove(folder)
    script = os.path.join(args.output, os.path.basename(script))
    written = [script, os.path.join(args.output, "plan.json")]
    if args.model_factory is None:
        written.append(os.path.join(args.output, MODEL_MODULE + ".py"))
    print("wrote " + ", ".join(written))
    print("run: " + run_hint(plan).replace(SCRIPT, script) + "   (docs/multinode.md)")
    return 0


def model_module(source: dict[str, Any]) -> str:
    """``planned_model.py``: ``build()`` builds the plan's model with real weights, the same on every rank;
    ``build(device="meta")`` its shapes only (what ``codegen --standalone`` exports)."""
    spec, seq_len, dtype = source["model"], source.get("seq_len"), source.get("dtype", "fp32")
    torch_dtype = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    if ":" in spec:
        module, fn = spec.split(":")
        imports = ["import inspect", "", "import torch", "", f"from {module} import {fn} as factory"]
        body = ['    takes_device = "device" in inspect.signature(factory).parameters',
                '    model, _ = factory(device=device) if takes_device else factory()']
    else:
        imports = ["import torch", "", "from autopar.models import registry"]
        body = [f'    model, _ = registry.build({spec!r}, seq_len={seq_len!r}, device=device, dtype={torch_dtype})']
    lines = [f'"""The model the plan was made for: {spec} ({dtype}). Edit build() to load a checkpoint."""', "",
             *imports, "", "", 'def build(device="cpu"):', "    torch.manual_seed(0)  # the same weights on every rank",
             *body, "    return model"]
    return "\n".join(lines) + "\n"


# --- models / demo -------------------------------------------------------------------------------
def run_models(args: argparse.Namespace) -> int:
    from ..models import registry
    for name in registry.names():
        print(registry.describe(name))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from ..demo import main
    main()
    return 0


# --- the parser ----------------------------------------------------------------------------------
def add_parsers(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="search the fastest plan that fits", description=(
        "Search data x tensor x pipeline parallelism (micro-batches, schedule, ZeRO, recompute, sequence "
        "parallel) for MODEL on the cluster, print the plan's summary, and optionally save it."))
    _model_args(plan)
    plan.add_argument("--fixed", default=None, metavar="FIELD=V,..",
                      help="pin ParallelConfig fields, e.g. tp=8,pp=4 (aliases mbs, v, sp)")
    plan.add_argument("--time-limit", type=float, default=None, metavar="S",
                      help="stop the search after S seconds with the best plan so far")
    plan.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE, metavar="F",
                      help="plans within this fraction of the fastest are ties, and the one with the fewest moving "
                           f"parts (ZeRO stage, parallel dimensions, interleaving) wins (default "
                           f"{DEFAULT_TIE_TOLERANCE:g}; 0: the fastest)")
    plan.add_argument("--ilp-node-limit", type=int, default=None, metavar="N",
                      help="branch-and-bound nodes per sharding ILP solve (default: autopar.plan's, 20000; 0: no "
                           "limit); a node limit keeps the plan independent of the machine's load")
    plan.add_argument("--ilp-time-limit", type=float, default=None, metavar="S",
                      help="also stop each sharding ILP solve after S seconds of wall clock (default: no clock "
                           "limit; a plan made with one may change with the machine's load)")
    _output_args(plan)
    plan.set_defaults(run=run_plan)

    est = sub.add_parser("estimate", help="predict one configuration's step time and memory", description=(
        "Predict step time, memory per stage and the breakdown of one configuration of MODEL."))
    _model_args(est)
    est.add_argument("--config", required=True, metavar="FIELD=V,..",
                     help="the configuration, e.g. dp=16,tp=8,pp=8,mbs=1,schedule=interleaved,v=2,recompute=full")
    _output_args(est)
    est.set_defaults(run=run_estimate)

    show = sub.add_parser("show", help="print a saved plan (summary, explanation, charts)",
                          description="Print a plan saved by `autopar plan -o` or Plan.save().")
    show.add_argument("plan", help="plan JSON file")
    _output_args(show, save=False)
    show.set_defaults(run=run_show)

    cmp_ = sub.add_parser("compare", help="two saved plans side by side",
                          description="Compare plan A with plan B; rows that differ are marked *.")
    cmp_.add_argument("a", help="plan A (JSON)")
    cmp_.add_argument("b", help="plan B (JSON)")
    cmp_.set_defaults(run=run_compare)

    gen = sub.add_parser("codegen", help="write a torchrun training script for a saved plan", description=(
        "Write OUT/train.py and OUT/plan.json (and OUT/planned_model.py, which builds the plan's model, unless "
        "--model-factory is given); run with torchrun."))
    gen.add_argument("plan", help="plan JSON file")
    gen.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder")
    gen.add_argument("--model-factory", default=None, metavar="PKG.MOD:FN",
                     help="function building the model with real weights (default: the plan's own MODEL); "
                          "--standalone builds it with device=\"meta\" when it takes a device: no weights allocated")
    gen.add_argument("--batch-factory", default=None, metavar="PKG.MOD:FN",
                     help="fn(step, global_batch_size) -> batch (default: zero inputs shaped like the plan's)")
    gen.add_argument("--loss-fn", default=None, metavar="PKG.MOD:FN", help="for models that return no loss: the "
                     "loss_fn the plan was made with (its module:qualname, as the plan records it)")
    gen.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    gen.add_argument("--standalone", action="store_true", help="compile the plan into OUT/program.py (each "
                     "layer's code on its shards, each chunk's dataflow) with a train.py that needs torch alone, "
                     "not autopar (no context / expert parallelism, no ZeRO-2/3 with tensor parallelism yet)")
    gen.set_defaults(run=run_codegen)

    models = sub.add_parser("models", help="list the built-in models", description="List the built-in MODEL names.")
    models.set_defaults(run=run_models)
    demo = sub.add_parser("demo", help="plan GPT-3 175B on 128 DGX A100 nodes (make demo)",
                          description="Plan GPT-3 175B on 128x8xA100-80GB and compare with Megatron-LM's config.")
    demo.set_defaults(run=run_demo)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a built-in name (`autopar models`) or package.module:factory returning (model, inputs)")
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="NODESxDEVICESxPRESET, e.g. 128x8xA100-80GB or 1x2xcpu; or 'local' (this machine, measured)")
    p.add_argument("--global-batch", type=int, required=True, metavar="N", help="samples per optimizer step")
    p.add_argument("--device-memory", type=float, default=None, metavar="GB",
                   help="memory per device in GB, replacing the preset's (e.g. to keep a reserve)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length of a built-in transformer")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="model dtype (default bf16 on accelerators, fp32 on CPUs)")
    p.add_argument("--profile", action="store_true",
                   help="time the model's own ops on this machine (needs --cluster local; builds real weights)")
    p.add_argument("--kernels", default="eager", choices=("eager", "fused", "compiled"),
                   help="the kernels to price: eager (default: what parallelize runs), fused (Megatron-LM's "
                        "hand-fused kernels: fewer bytes moved) or compiled (torch.compile: fewer bytes moved "
                        "and kept)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _output_args(p: argparse.ArgumentParser, save: bool = True) -> None:
    if save:
        p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="save the plan as JSON")
    p.add_argument("--explain", action="store_true", help="also print why this plan (Plan.explain)")
    p.add_argument("--json", action="store_true", help="print the plan's JSON instead of the summary")
    p.add_argument("--timeline", default=None, metavar="PNG", help="write the pipeline timeline chart")
    p.add_argument("--memory", default=None, metavar="PNG", help="write the memory-per-stage chart")
    p.add_argument("--partition", default=None, metavar="PNG", help="write the layer-to-stage chart")
