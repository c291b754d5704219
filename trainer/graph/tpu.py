"""The TPU path of the graph step (torch-tpu's `tpu` compile backend). Not run on a TPU yet.

Only imported when `backend == "tpu"`, which the step plan's rules allow only on a TPU device,
so nothing here touches torch-tpu on a CPU/GPU host (importing it there changes torch's
globals; see docs/tpu.md). Written against torch-tpu 0.2.0's API as read from the package,
never run on a TPU (docs/tpu.md):

- `spmd_safe(step_fn)`: the traced step runs under `torch.tpu.distributed.spmd_safe`, so
  torch-tpu does not split the compiled program at every SimpleFSDP / TP collective (its
  default, for safety when ranks could diverge); every rank runs the same step, so one XLA
  program per step is correct.
- `compile_dynamo_graph`: the same capture as on cpu/cuda (AOTAutograd -> our pass
  pipeline on the ATen graph -> dump), then the transformed ATen graph is handed to the
  registered `tpu` backend, which lowers it (scan -> `stablehlo.while`) to one PJRT
  executable. Static shapes only (the step is compiled with `dynamic=False`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from models.errors import ConfigError
from trainer.step.plan import BACKENDS


def _torch_tpu():
    from trainer.runtime.device import tpu_present

    if not tpu_present():
        raise ConfigError(
            f"compile.backend: tpu needs torch-tpu and a TPU; allowed here: {', '.join(b for b in BACKENDS if b != 'tpu')}"
        )
    return torch.tpu  # installed by torch-tpu's autoload on a TPU host


def register_barrier() -> None:
    """Serve the remat fence `titan::optimization_barrier` (trainer/graph/remat.py) on the TPU
    with torch-tpu's `optimization_barrier` (-> `stablehlo.optimization_barrier`), so the graph's
    recomputed ops survive XLA's CSE. Idempotent."""
    if _BARRIER_IMPL:
        return
    tpu_ops = _torch_tpu().ops
    lib = torch.library.Library("titan", "IMPL")  # noqa: TOR901 (kept alive below)
    lib.impl("optimization_barrier", lambda xs: list(tpu_ops.optimization_barrier(list(xs))), "PrivateUse1")
    _BARRIER_IMPL.append(lib)


_BARRIER_IMPL: list = []


def spmd_safe(step_fn: Callable) -> Callable:
    """`step_fn` traced under torch-tpu's SPMD annotation (collectives stay in one program)."""
    return _torch_tpu().distributed.spmd_safe(step_fn)


def compile_dynamo_graph(
    gm: fx.GraphModule, example_inputs: list, *, on_graph: Callable[[fx.GraphModule], None]
) -> Callable:
    """AOT-capture `gm`, run `on_graph` (passes, stats, dump), compile with the `tpu` backend."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.registry import lookup_backend
    from torch._functorch.aot_autograd import aot_module_simplified

    _torch_tpu()
    register_barrier()
    tpu_backend = lookup_backend("tpu")

    def compile_aten(graph: fx.GraphModule, inputs):
        on_graph(graph)
        # The ATen graph is itself a valid graph for a Dynamo backend: torch-tpu runs its
        # AOT stage on it again (a no-op on already functional ATen) and lowers it.
        compiled = tpu_backend(graph, inputs, options={"name": "titan_train_step", "async_compile": False})
        return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)

    return aot_module_simplified(gm, example_inputs, fw_compiler=compile_aten, keep_inference_input_mutations=True)
