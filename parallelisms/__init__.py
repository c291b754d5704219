"""Parallelisms that act on any model through its plan: mesh, TP, AC, compile, SimpleFSDP.

Entry points: `ParallelDims` + `build_mesh` (degrees and the named DeviceMesh) and
`parallelize_model` (TP -> EP -> AC -> compile -> SimpleFSDP). See docs/parallelism.md.
"""

from parallelisms.activation_checkpoint import AC_MODES, apply_ac, checkpoint_fn
from parallelisms.compile import apply_compile
from parallelisms.parallel_dims import ParallelDims, build_ep_mesh, build_mesh, dp_shard_cp_mesh, flat_dp_mesh
from parallelisms.parallelize import parallelize_model
from parallelisms.simple_fsdp import (
    clip_grad_norm_,
    data_parallel,
    disable_active_parametrization,
    local_bytes,
)
from parallelisms.tensor_parallel import apply_tp, loss_parallel_context

__all__ = [
    "AC_MODES",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_tp",
    "build_ep_mesh",
    "build_mesh",
    "checkpoint_fn",
    "clip_grad_norm_",
    "data_parallel",
    "dp_shard_cp_mesh",
    "disable_active_parametrization",
    "flat_dp_mesh",
    "local_bytes",
    "loss_parallel_context",
    "parallelize_model",
]
