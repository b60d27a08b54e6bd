"""The optimizer step of a compiled program: the optimizer's own ``step`` through ``torch.compile``.

A compiled program (``parallelize(..., compile=True)``, ``train.py --compile``) compiles its
optimizer's step as well as its chunks, as torch's "compiling the optimizer" recipe does:
inductor fuses the update (AdamW: weight decay, both moments, the bias corrections and the step,
about 8 tensor ops per parameter) into one kernel, a loop over each parameter. Eager, each of those
ops is a pass over memory and a dispatch: torch's default AdamW on a CPU is the single-tensor loop
(multi-tensor kernels are CUDA's). On a CPU the gain depends on the C allocator: eager, some ops make a
temporary of each parameter's size, and where glibc maps those afresh (page faults) the compiled step
takes under half the eager one's time; where it reuses heap memory, as a CPU rank's does
(host_heap.py), it gains 15-35% (BENCHMARKS.md, runtime overhead).

The step is compiled from its second call on: the first initialises the optimizer's state
(``torch.optim`` creates it lazily, inside ``step``), and a step compiled on the empty state would
be compiled again at once. It stays a bound method of the optimizer, so that user code calling
``optimizer.step()`` and learning-rate schedulers (which wrap ``optimizer.step.__func__``) run the
compiled step. A learning rate that changes is a float that dynamo does not specialise on
(``torch._dynamo.config.specialize_float``, False by default in torch 2.13), so a schedule costs one
recompile, not one a step (tests/unit/codegen/test_optim.py).

Imports only torch: the standalone folder (standalone.py) carries this file beside its train.py.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch


def compile_step(optimizer: torch.optim.Optimizer, backend: str | Callable[..., Any]) -> None:
    """Replace ``optimizer.step`` by itself compiled with ``backend`` (a torch.compile backend), from its
    second call on."""
    eager = optimizer.step
    compiled = torch.compile(eager, backend=backend)
    calls = 0

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return (eager if calls == 1 else compiled)(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)
