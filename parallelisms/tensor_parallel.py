"""Tensor (and sequence) parallelism from a model's declarative plan.

`apply_tp` reads `ModelPlan.tp` (paths relative to the model) and `ModelPlan.tp_block`
(paths relative to each block), maps each style string to a
`torch.distributed.tensor.parallel` style and applies it with `parallelize_module` on the
`tp` mesh. Between blocks the residual stream is sequence-sharded (dim 1), as in
TorchTitan; inside attention the heads are split (local heads = n_heads / tp), so the
model's `view(bsz, seqlen, -1, head_dim)` sees the local head count. Buffers (RoPE
tables) are not touched and stay replicated plain tensors.

Models without sequence parallelism (FLUX: the residual stream is replicated over TP between
blocks) use "colwise" in-projections on their replicated input, "rowwise_replicate"
out-projections (all-reduce instead of reduce-scatter) and "replicate" for small modules
every rank runs in full (adaLN modulation); see models/common/plan.py.

Each block submodule that gets a style also records it (`block_style`: style, TP group, the
ids of the hooks the style registered), so that layer scan can run the block on local tensors
with the same collectives (parallelisms/scan.py).

Loss parallel (`enable_loss_parallel=True`) leaves the logits as a vocab-sharded DTensor;
compute the loss inside `loss_parallel_context(True)`. By default the logits are gathered
to full vocab and returned as a plain tensor.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from models.common.plan import ModelPlan
from models.errors import ConfigError

__all__ = ["BlockStyle", "apply_tp", "block_style", "loss_parallel_context", "style_for"]


class GatherSequenceInput(ParallelStyle):
    """All-gather the first positional input from sequence shards to the full sequence.

    A module called with keywords only (Hugging Face layers call `self_attn(hidden_states=...)`)
    has its `hidden_states` keyword gathered instead. Like `PrepareModuleInput(input_layouts=(Shard(1), ...), desired_input_layouts=
    (Replicate(), ...))` but independent of how many other inputs the module takes. The
    result stays a DTensor so that the colwise projections consume it directly and the
    backward of the gather is a reduce-scatter of their partial input gradients.
    """

    def __init__(self, sequence_dim: int = 1) -> None:
        self.sequence_dim = sequence_dim

    def _full(self, x, mesh: DeviceMesh) -> DTensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(self.sequence_dim),), run_check=False)
        return x.redistribute(mesh, (Replicate(),))

    def _gather(self, module: nn.Module, args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple:
        if not args and "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self._full(kwargs["hidden_states"], mesh)}
        x, *rest = args
        return (self._full(x, mesh), *rest), kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._gather(mod, args, kwargs, device_mesh), with_kwargs=True
        )
        return module


class EmbeddingParallel(RowwiseParallel):
    """Vocab-sharded embedding whose sequence-sharded output is a plain tensor.

    RowwiseParallel's reduce-scatter is asynchronous and its output an
    AsyncCollectiveTensor; fed as input to a compiled block, AOTAutograd returns its
    gradient as a plain tensor where DTensor's redistribute backward needs a DTensor. The
    wait here is free (the next block needs the value anyway) and keeps autograd.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(1))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(lambda mod, args, out: _wait(out))
        return module


class ReplicateParallel(ParallelStyle):
    """Parameters (the module's and its submodules') become `Replicate()` DTensors on the TP mesh;
    plain inputs are declared replicated and the output is returned as a plain tensor.

    For modules that every TP rank runs in full on the same (replicated) input, e.g. FLUX's adaLN
    modulation linears inside the blocks, DeepSeek-V4's KV compressors and indexer (whose
    submodules then compute on replicated DTensors). Each rank computes the same full
    gradient, so none is summed over TP (a `Replicate` gradient needs no reduction), and the
    parameters are TP DTensors like the rest of the block for SimpleFSDP on a 2-D mesh.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                replicated = DTensor.from_local(param.detach(), device_mesh, (Replicate(),), run_check=False)
                owner.register_parameter(name, nn.Parameter(replicated, param.requires_grad))

        def to_dtensor(mod, args):
            return tuple(
                DTensor.from_local(a, device_mesh, (Replicate(),), run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


class HeadSharedParallel(ParallelStyle):
    """Identity forward, gradient summed over the TP ranks in the backward ("head_shared").

    For a tensor every rank holds in full but uses only for its own heads (MLA's RoPE key, one
    for all heads): each rank's gradient is the part of the sum over its heads. The input is
    declared `Replicate` and handed on as a local tensor whose gradient is declared `Partial`,
    so the `from_local` backward all-reduces it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert not list(module.parameters()), "head_shared: for parameter-free modules"

        def pre_hook(mod, args):
            x, *rest = args
            if isinstance(x, DTensor):
                x = x.to_local()
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return (x.to_local(grad_placements=(Partial(),)), *rest)

        module.register_forward_pre_hook(pre_hook)
        return module


class SequenceLocalParallel(SequenceParallel):
    """A per-token module on the sequence-sharded residual stream that takes and returns plain
    local tensors ("sequence_local"): DeepSeek-V4's hyper-connections, whose forward returns a
    tuple (the stream weights and the collapsed input). As `SequenceParallel`: the weights are
    `Replicate()` DTensors whose gradients are summed over the TP ranks (each holds other tokens);
    the input is declared sequence-sharded (dim 1) and every tensor of the output is handed on as
    its local shard."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=1, use_local_output=True)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        return tuple(local(t) for t in outputs) if isinstance(outputs, tuple) else local(outputs)


class GroupedColwiseParallel(ParallelStyle):
    """A grouped linear (`weight` [groups x out, in], group g's rows g x out .. (g + 1) x out; the
    input `[..., groups, in]`) split by group ("grouped_colwise"): DeepSeek-V4's `wo_a`, whose groups
    are consecutive heads, so a rank holding heads `r H / tp ..` holds groups `r G / tp ..` (tp must
    divide the groups). The weight is `Shard(0)`; the plain input holds the rank's groups
    (`Shard(-2)`), the output is the rank's groups as a plain tensor, for a rowwise projection after."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _shard_params(module, device_mesh)

        def to_dtensor(mod, args):
            x, *rest = args
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(x.dim() - 2),), run_check=False)
            return (x, *rest)

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


class HeadShardedParallel(ParallelStyle):
    """A module holding per-head parameters, heads on dim 0, and returning them ("head_sharded":
    DeepSeek-V4's sinks): split by head like a colwise projection's rows (`Shard(0)`), so each rank
    holds and trains its own heads'; the output is the rank's heads as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _shard_params(module, device_mesh)
        module.register_forward_hook(lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


class SequenceShardParallel(ParallelStyle):
    """A parameter-free pass-through on a tensor every rank holds in full (the token ids), handing
    on this rank's sequence shard (dim 1: the tokens of its sequence-parallel stream) as a plain
    tensor ("sequence_shard": DeepSeek-V4's hash routing looks its experts up from the token ids of
    the rows its MoE layer holds). A local slice, no communication."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert not list(module.parameters()), "sequence_shard: for parameter-free modules"

        def pre_hook(mod, args):
            x, *rest = args
            full = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return (full.redistribute(device_mesh, (Shard(1),)).to_local(), *rest)

        module.register_forward_pre_hook(pre_hook)
        return module


def _shard_params(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """The module's own parameters become `Shard(0)` DTensors, each rank keeping its local chunk
    (every rank holds the same meta or seeded weights: no scatter from rank 0)."""
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.detach(), device_mesh, (Shard(0),), src_data_rank=None)
        module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


def _wait(tensor):
    return funcol.wait_tensor(tensor) if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def style_for(style: str, *, enable_loss_parallel: bool = False) -> ParallelStyle:
    """The parallel style object of one plan entry (see models/common/plan.py)."""
    if style == "embedding":
        result = EmbeddingParallel()
    elif style == "colwise":
        result = ColwiseParallel()
    elif style == "rowwise":
        result = RowwiseParallel(output_layouts=Shard(1))
    elif style == "rowwise_replicate":
        # No sequence parallelism: the partial sums are all-reduced to a replicated output.
        result = RowwiseParallel(output_layouts=Replicate())
    elif style == "replicate":
        result = ReplicateParallel()
    elif style == "sequence_parallel":
        result = SequenceParallel()
    elif style == "head_norm":
        # (batch, seq, heads, head_dim): heads are the TP-sharded dim here.
        result = SequenceParallel(sequence_dim=2, use_local_output=True)
    elif style == "head_shared":
        result = HeadSharedParallel()
    elif style == "sequence_local":
        result = SequenceLocalParallel()
    elif style == "grouped_colwise":
        result = GroupedColwiseParallel()
    elif style == "head_sharded":
        result = HeadShardedParallel()
    elif style == "sequence_shard":
        result = SequenceShardParallel()
    elif style == "block_input":
        result = GatherSequenceInput()
    elif style == "output":
        result = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if enable_loss_parallel else Replicate(),
            use_local_output=not enable_loss_parallel,
        )
    else:
        raise AssertionError(f"unknown TP style {style!r}")
    # Every rank holds the same (meta or seeded) weights: take the local copy instead of
    # broadcasting/scattering from rank 0, which also keeps meta-device TP free of comms.
    result.src_data_rank = None
    return result


def apply_tp(
    model: nn.Module,
    *,
    plan: ModelPlan,
    tp_mesh: DeviceMesh,
    enable_loss_parallel: bool = False,
) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following `plan`; returns the model."""
    tied = _tied_parameters(model)
    root = {path: style_for(style, enable_loss_parallel=enable_loss_parallel) for path, style in plan.tp.items()}
    if root:
        parallelize_module(model, tp_mesh, root)
    for _, block in plan.iter_blocks(model):
        # One plan serves blocks of different kinds (dense FFN or MoE): entries for
        # modules a block does not have are skipped.
        present = {path: style for path, style in plan.tp_block.items() if _has_submodule(block, path)}
        targets = {path: _matching(block, path) for path in present}
        before = {id(m): _hook_ids(m) for modules in targets.values() for m in modules}
        parallelize_module(block, tp_mesh, {path: style_for(style) for path, style in present.items()})
        group = (tp_mesh.get_group().group_name, tp_mesh.size())
        for path, modules in targets.items():
            for module in modules:
                pre, post = _hook_ids(module)
                old_pre, old_post = before[id(module)]
                module._tp_block_style = BlockStyle(present[path], group, pre - old_pre, post - old_post)
    _retie(tied)
    return model


@dataclass(frozen=True)
class BlockStyle:
    """What `apply_tp` did to one module inside a block, for layer scan (parallelisms/scan.py).

    The scan body runs the block on local tensors, so it replaces the hooks the style registered
    (`pre_hooks`, `hooks`: their ids in the module's hook dicts) by explicit collectives on
    `group` (process-group name, size)."""

    style: str
    group: tuple[str, int]
    pre_hooks: frozenset[int]
    hooks: frozenset[int]


def block_style(module: nn.Module) -> BlockStyle | None:
    """The TP style `apply_tp` gave this block submodule (None: not tensor-parallel)."""
    return getattr(module, "_tp_block_style", None)


def _hook_ids(module: nn.Module) -> tuple[frozenset[int], frozenset[int]]:
    return frozenset(module._forward_pre_hooks), frozenset(module._forward_hooks)


def _matching(block: nn.Module, path: str) -> list[nn.Module]:
    """The submodules of `block` that `path` names (`*` matches one path component)."""
    parts = path.split(".")
    return [
        module
        for name, module in block.named_modules()
        if name
        and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(n, p) for n, p in zip(name.split("."), parts))
    ]


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, name) that share one Parameter (e.g. tied embedding and output)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """TP styles replace each module's parameters separately; share them again.

    Possible when every copy got the same layout: the vocab-sharded embedding (rowwise) and
    the colwise LM head both split the (vocab, dim) matrix along vocab, Shard(0).
    """
    for group in groups:
        first_module, first_name = group[0]
        shared = first_module._parameters[first_name]
        for module, name in group[1:]:
            param = module._parameters[name]
            same = (
                isinstance(param, DTensor) == isinstance(shared, DTensor)
                and (not isinstance(param, DTensor) or param.placements == shared.placements)
                and param.shape == shared.shape
            )
            if not same:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree: tied parameter {name!r} gets different "
                    f"tensor-parallel layouts; allowed: 1 for this model"
                )
            module._parameters[name] = shared


def _has_submodule(module: nn.Module, path: str) -> bool:
    if "*" in path:
        return True  # parallelize_module matches wildcards itself
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for the loss computation: `loss_parallel()` when logits are vocab-sharded."""
    return loss_parallel() if enabled else contextlib.nullcontext()
