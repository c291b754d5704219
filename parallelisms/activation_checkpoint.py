"""Activation checkpointing per block, without changing module paths.

Modes:
- "none": keep every activation.
- "full": keep only each block's inputs; recompute the whole block in backward.
- "full_save_attention": "full", but the attention kernels' outputs (the output and the
  log-sum-exp residual of splash / SDPA / the CPU kernel) are saved, so the backward recomputes
  the block's projections, norms, RoPE and MLP but not the attention forward: MaxText's remat
  policies that keep the attention output, TorchTitan's op-level SAC saving SDPA. It keeps
  (2 x head width + 4 x heads) bytes per token and block more than "full" (bf16 output, fp32
  log-sum-exp), and skips the attention forward's FLOPs in the backward (at 8k tokens about a
  quarter of a Llama 3 8B block's forward).
- "selective": op-level SAC (`create_selective_checkpoint_contexts`). Saved (MUST_SAVE):
  outputs of matmuls (mm, addmm, bmm, grouped/scaled mm), of attention kernels (every
  SDPA backend) and of TP reduce-scatters (so backward does not repeat that
  communication). Everything else (pointwise ops, norms, RoPE, activations, casts and the
  SimpleFSDP all-gathers, which then act as reshard-after-forward) is recomputed.

`apply_ac` swaps each block's class for a subclass whose `forward` runs the original one
under `checkpoint_fn(mode)`; parameters and state-dict keys stay where they were (no
`_checkpoint_wrapped_module`). The graph trainer reuses `checkpoint_fn(mode)` to remat
its scanned block body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import titan_kernels
from models.common.plan import ModelPlan
from models.errors import check_choice

__all__ = ["AC_MODES", "FULL_MODES", "apply_ac", "check_ac_mode", "checkpoint_fn", "is_attention_op", "sac_policy"]

AC_MODES = ("none", "full", "selective", "full_save_attention")
"""`[activation_checkpoint] mode` choices: the one home of the list (the config, the planner and
`checkpoint_fn` refuse another value through `check_ac_mode`)."""


FULL_MODES = ("full", "full_save_attention")
"""The modes that keep only the block inputs (and, for the second, the attention outputs)."""


def check_ac_mode(mode: str) -> str:
    """`mode`, or the ConfigError naming `activation_checkpoint.mode` and AC_MODES."""
    check_choice("activation_checkpoint.mode", mode, AC_MODES)
    return mode


def _aten_ops(names) -> set:
    """The ATen overloads of `names` this torch build has."""
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


_ATTENTION_ATEN = _aten_ops(
    (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
)
"""Every SDPA backend's attention kernel: saved by "selective" and by "full_save_attention"."""

_SAVE_OPS = (
    _aten_ops(("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm"))
    | _ATTENTION_ATEN
    | {torch.ops._c10d_functional.reduce_scatter_tensor.default}
)
_ATTENTION_KERNELS = ("splash", "sink", "attn")
"""Name prefixes of our attention kernels' ops (`titan*` namespaces): titan_tpu's splash / CP
splash / sink splash (titan_kernels/tpu/register.py), the deviceless compile's titan_capture /
titan_program stand-ins, titan_cpu's attention kernel. Their backward ops run outside the
checkpointed forward, so only the forward ones ever meet the policy."""


def is_attention_op(func: Any) -> bool:
    """An attention kernel's forward (SDPA's ATen kernels, our splash / sink / CPU kernels): the
    ops whose outputs "full_save_attention" saves."""
    if func in _ATTENTION_ATEN:
        return True
    namespace, name = getattr(func, "namespace", ""), getattr(func, "_opname", "")
    return namespace.startswith("titan") and name.startswith(_ATTENTION_KERNELS)


def sac_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective AC: save matmul / attention / reduce-scatter outputs, recompute the rest."""
    del ctx, args, kwargs
    save = func in _SAVE_OPS or func in titan_kernels.saved_ops()
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(sac_policy)


def save_attention_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """ "full_save_attention": save the attention kernels' outputs, recompute every other op."""
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if is_attention_op(func) else CheckpointPolicy.MUST_RECOMPUTE


def _save_attention_context():
    return create_selective_checkpoint_contexts(save_attention_policy)


def _no_checkpoint(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def checkpoint_fn(mode: str) -> Callable[..., Any]:
    """`f(fn, *args, **kwargs) -> fn(*args, **kwargs)`, checkpointed as `mode` says."""
    check_ac_mode(mode)
    if mode == "none":
        return _no_checkpoint
    if mode == "full":
        return functools.partial(checkpoint, use_reentrant=False)
    if mode == "selective":
        return functools.partial(checkpoint, use_reentrant=False, context_fn=_sac_context)
    if mode == "full_save_attention":
        return functools.partial(checkpoint, use_reentrant=False, context_fn=_save_attention_context)
    raise AssertionError(mode)  # check_ac_mode refused every other mode


_CLASS_CACHE: dict[tuple[type, str], type] = {}


def _checkpointed_class(base: type, mode: str) -> type:
    key = (base, mode)
    if key not in _CLASS_CACHE:
        run = checkpoint_fn(mode)

        def forward(self, *args, **kwargs):
            return run(base.forward, self, *args, **kwargs)

        _CLASS_CACHE[key] = type(
            f"Checkpointed{base.__name__}", (base,), {"forward": forward, "_ac_base": base, "_ac_mode": mode}
        )
    return _CLASS_CACHE[key]


def apply_ac(model: nn.Module, *, plan: ModelPlan, mode: str) -> nn.Module:
    """Checkpoint every block of `model` (children of the plan's stacks) in place."""
    checkpoint_blocks([block for _, block in plan.iter_blocks(model)], mode)
    return model


def checkpoint_blocks(blocks: list[nn.Module], mode: str) -> None:
    """Checkpoint `blocks` in place as `apply_ac` does (a class swap: keys and hooks unchanged);
    also a layer scan's unrolled prefix (trainer/graph/step.py `_enable_scans`)."""
    run = checkpoint_fn(mode)  # validates mode
    if run is _no_checkpoint:
        return
    for block in blocks:
        assert not hasattr(type(block), "_ac_base"), "activation checkpointing applied twice"
        block.__class__ = _checkpointed_class(type(block), mode)
