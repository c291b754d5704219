"""The real plan on a fake world: the parameter elements one rank holds.

Inside `fake_process_group(world_size)` (PyTorch's "fake" backend: collectives are no-ops, so
one process can be rank 0 of 1024) the planner builds the real mesh (`build_mesh`), the real
flavor on the meta device and applies the real plan (`parallelize_model`: TP, EP,
SimpleFSDP). Per-device parameter elements are the sum of the local DTensor shards
(`ShardStats`). Rank 0 is the one reported: `torch.chunk` gives it the largest piece of every
unevenly split tensor.

A model is read only through its family's contract (`models/contract.py`): the repeated
blocks live under `family.plan.block`, and the plan's tensor-parallel styles name the
embedding ("embedding") and the LM head ("output"); a plan without TP styles (a family that
refuses TP: Qwen 3.5, DeepSeek-V4) has the decoder's own names (`root_roles`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from models.common import distributed

if TYPE_CHECKING:
    from models import ModelFamily
    from models.contract import ModelArgs
    from parallelisms.parallel_dims import ParallelDims


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank `rank` of `world_size` on PyTorch's fake backend (collectives do nothing).

    Meshes, DTensors and the plan are built exactly as in a real job; tensors stay on meta.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if distributed.is_up():
        raise RuntimeError("the planner needs its own (fake) process group, but one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Mesh axes whose shards SimpleFSDP all-gathers before use (with context parallelism it shards over
# the flattened `dp_shard_cp`); every other axis (tp, ep) stays split.
_DP_AXES = frozenset({"dp_replicate", "dp_shard", "dp", "efsdp", "dp_shard_cp"})


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _gathered_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of `param` after the data-parallel all-gather (still TP/EP-sharded)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return tuple(param.shape)
    shape = list(param.shape)
    names = param.device_mesh.mesh_dim_names or ()
    for axis, placement in enumerate(param.placements):
        if names[axis] not in _DP_AXES and isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(axis))
    return tuple(shape)


def _gathered_numel(param: torch.Tensor) -> int:
    """Elements of `param` after the data-parallel all-gather (still TP/EP-sharded)."""
    return math.prod(_gathered_shape(param))


@dataclass(frozen=True)
class ShardStats:
    """Parameter elements one rank holds after the real plan (rank 0 of the fake world)."""

    n_layers: int
    root_numel: int
    """Local elements of the parameters outside the blocks (embedding, final norm, output)."""
    blocks_numel: int
    """Local elements of all blocks together."""
    block_gathered_numel: int
    """Elements of the largest block after the dp all-gather (what SimpleFSDP materializes in bf16)."""
    blocks_gathered_numel: int
    """Elements of all blocks after the dp all-gather (what the backward keeps in bf16 without AC;
    n_layers x `block_gathered_numel` when the blocks are all alike)."""
    largest_block_param_gathered: int
    """Elements of the largest single block parameter after the dp all-gather."""
    root_gathered: dict[str, int]
    """Per root parameter: elements after the dp all-gather."""
    lm_head_gathered_numel: int
    """The LM head (the plan's "output" module, or the "embedding" one when the weights are
    tied) after the dp all-gather."""
    root_kept_gathered_numel: int
    """Root parameters after the dp all-gather whose bf16 copies the backward keeps: all but an
    untied embedding table (a lookup), i.e. the LM head and the final norm."""
    local_shapes: dict[str, tuple[int, ...]]
    """Local shard shape of each root parameter and of block 0's parameters."""
    probed: bool
    """True when one block was sharded and multiplied by n_layers (blocks are identical)."""

    muon_numel: int = 0
    """Local elements of the parameters Muon would update (`trainer.optim.muon.split_muon_params` with
    the recipe's `muon_exclude`; by default the blocks' and root's matrices but the embedding,
    head and router)."""
    muon_whole_numel: int = 0
    """Elements of whole matrices one rank holds at once in Muon's update, for the parameter where
    that is largest: ceil(B/D) x m x n after the all-to-all (`trainer.graph.optim.orthogonalize_sharded`),
    B the matrices of this rank's leading dims (experts), D the ranks splitting a matrix dim."""
    muon_whole_stacked_numel: int = 0
    """The same with layer scan: B counts a whole stack's layers."""
    embedding_numel: int = 0
    """Local elements of the token embedding (the plan's "embedding" module): the part of
    `root_numel` a pipeline's first stage holds alone (planner/pipeline.py; the pipeline rules
    refuse tied embeddings, whose table is the head too)."""
    embedding_gathered_numel: int = 0
    """The token embedding after the dp all-gather (still TP-sharded: the vocab-sharded table's rows
    on this rank): what the embedding backward's scatter-add writes (planner/memory.py
    `embedding_backward_bytes`). Counted only where `embedding_numel` is not 0 (a pipeline stage
    that holds the embedding)."""
    linear_shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    """Every `nn.Linear` at the root and in the first block of each stack, by module path: its
    weight's (out, in) features whole and after the dp all-gather (still TP-sharded). What
    `[quantize]` may quantize (planner/low_precision.py)."""
    stacks: tuple[tuple[int, int, int, int], ...] = ()
    """Per stack of the plan (`family.plan.stacks`, in the forward's order): (its blocks, their local
    elements, their elements after the dp all-gather, Muon's local elements of them). What a
    pipeline stage holds of a model of dense blocks then MoE blocks (DeepSeek-V3's `dense_layers`,
    `moe_layers`) is counted per stack (planner/pipeline.py `stage_stats`); empty: one kind of block."""

    @property
    def param_numel(self) -> int:
        return self.root_numel + self.blocks_numel


def build_parallel_model(
    family: ModelFamily,
    args: ModelArgs,
    parallel_dims: ParallelDims,
    *,
    ac_mode: str = "none",
    enable_loss_parallel: bool = False,
) -> nn.Module:
    """Meta model -> the project's `parallelize_model` on the real mesh (needs a process group)."""
    from parallelisms.parallel_dims import build_mesh
    from parallelisms.parallelize import parallelize_model

    mesh = build_mesh(parallel_dims, "cpu") if parallel_dims.world_size > 1 else None
    with torch.device("meta"):
        model = family.model_cls(args)
    return parallelize_model(
        model,
        plan=family.plan,
        parallel_dims=parallel_dims,
        mesh=mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        ac_mode=ac_mode,
        compile_backend=None,
        enable_loss_parallel=enable_loss_parallel,
    )


def shard_model(
    family: ModelFamily,
    args: ModelArgs,
    parallel_dims: ParallelDims,
    *,
    probe: bool = False,
    muon_exclude: tuple[str, ...] | None = None,
) -> ShardStats:
    """Apply the real plan to the meta model on the current (fake) world; count rank 0's shards.

    `probe=True` shards a one-block copy and multiplies the block by `n_layers`; exact for
    these models, whose blocks all have the same parameters, and fast for 100+ layers. A model of
    dense blocks then MoE blocks (DeepSeek-V3: `n_dense_layers`, two stacks) is probed with one
    block of each stack, each multiplied by its stack's length.
    """
    assert distributed.world_size() == parallel_dims.world_size and distributed.is_up(), (
        "run shard_model inside fake_process_group(parallel_dims.world_size)"
    )
    prefixes = tuple(f"{stack}." for stack in family.plan.stacks)
    probe, probe_args, stack_lengths = _probe_plan(args, prefixes, probe)
    model = build_parallel_model(family, probe_args, parallel_dims)
    from trainer.optim.muon import (
        MUON_EXCLUDE_DEFAULT,
        split_muon_params,  # the optimizer's own rule for which parameters are Muon's
    )

    exclude = MUON_EXCLUDE_DEFAULT if muon_exclude is None else tuple(muon_exclude)
    vectors = getattr(model, "non_matrix_params", ())
    muon_ids = {id(p) for p in split_muon_params(model.named_parameters(), exclude, non_matrices=vectors)[0]}
    t = _tally_params(model, prefixes, muon_ids)
    assert t.first_block is not None, f"no parameters under the plan's block attributes {family.plan.stacks}"
    if probe:  # each probed block times its stack's length over the probe's blocks in that stack
        probed = {p: sum(b.startswith(p) for b in t.block_local) for p in prefixes}
        count = lambda block: next(stack_lengths[p] // probed[p] for p in prefixes if block.startswith(p))  # noqa: E731
    else:
        count = lambda block: 1  # noqa: E731
    # per stack: (blocks, local, gathered, Muon's local) elements
    per_stack = tuple(
        (
            stack_lengths[p] if probe else sum(b.startswith(p) for b in t.block_local),
            sum(n * count(b) for b, n in t.block_local.items() if b.startswith(p)),
            sum(n * count(b) for b, n in t.block_gathered.items() if b.startswith(p)),
            sum(n * count(b) for b, n in t.muon_block.items() if b.startswith(p)),
        )
        for p in prefixes
    )
    blocks_numel = sum(s[1] for s in per_stack)
    blocks_gathered = sum(s[2] for s in per_stack)
    muon_numel = t.muon_root + sum(s[3] for s in per_stack)
    # Layers per stack (what layer scan stacks): the probe's stack lengths, else the blocks seen.
    layers = {p: stack_lengths[p] if probe else sum(b.startswith(p) for b in t.block_local) for p in prefixes}
    whole = max((_muon_whole_numel(p, 1) for p, _ in t.muon_params), default=0)
    whole_stacked = max(
        (_muon_whole_numel(p, 1 if prefix is None else layers[prefix]) for p, prefix in t.muon_params), default=0
    )
    head, kept = _lm_head_and_kept(family, t.root_gathered)
    embedding_modules = {p for p, style in root_roles(family).items() if style == "embedding"}
    embedding_local = sum(n for name, n in t.root_local.items() if name.rpartition(".")[0] in embedding_modules)
    embedding_gathered = sum(n for name, n in t.root_gathered.items() if name.rpartition(".")[0] in embedding_modules)
    return ShardStats(
        n_layers=args.n_layers,
        root_numel=t.root_numel,
        blocks_numel=blocks_numel,
        block_gathered_numel=max(t.block_gathered.values()),
        blocks_gathered_numel=blocks_gathered,
        largest_block_param_gathered=t.largest,
        root_gathered=t.root_gathered,
        lm_head_gathered_numel=head,
        root_kept_gathered_numel=kept,
        local_shapes=t.shapes,
        probed=probe,
        muon_numel=muon_numel,
        muon_whole_numel=whole,
        muon_whole_stacked_numel=whole_stacked,
        embedding_numel=embedding_local,
        embedding_gathered_numel=embedding_gathered,
        linear_shapes=_linear_shapes(model, prefixes),
        stacks=per_stack if len(prefixes) > 1 else (),
    )


def _block_period(args: ModelArgs) -> int | None:
    """0 when a stack's blocks all have the same parameters; for Qwen 3.5's Gated DeltaNet and
    full-attention blocks (`full_attention_interval`; gpt-oss's sliding and full blocks have the
    same parameters) the period they repeat with, None when n_layers is not a multiple of it, and
    None for DeepSeek-V4's blocks (`layer_kinds`: sliding, CSA and HCA blocks hold different
    compressors, its first `num_hash_layers` a hash table; the schedule is per block, so a shorter
    stack is not the same model: sharded whole, on meta)."""
    if hasattr(args, "layer_kinds"):
        return None if len(set(args.layer_kinds())) > 1 or 0 < args.num_hash_layers < args.n_layers else 0
    if not hasattr(args, "linear_num_value_heads") or len(set(args.layer_types())) < 2:
        return 0
    period = args.full_attention_interval
    return period if args.n_layers % period == 0 else None


def scan_layout(args: ModelArgs) -> tuple[int, int] | None:
    """(k, p) with which layer scan runs a stack whose blocks differ along it by `args`
    (DeepSeek-V4: the attention kind of `layer_kinds` and the first `num_hash_layers`
    hash-routed blocks): k blocks unrolled, then the rest p per scan step (the stack's own
    `BlockStack.scan_layout`, from the same `periodic_layout`; flash: 3, 2). None for the other
    families (the activation model's `period`, no prefix) and for a schedule without a periodic
    tail (whose scan is refused)."""
    if not hasattr(args, "layer_kinds"):
        return None
    from models.common.stack import periodic_layout

    return periodic_layout([(kind, args.is_hash_layer(i)) for i, kind in enumerate(args.layer_kinds())])


def _probe_plan(args: ModelArgs, prefixes: tuple[str, ...], probe: bool) -> tuple[bool, ModelArgs, dict[str, int]]:
    """(whether to probe, the args to shard, each probed stack's length). A one-block probe
    replaces n_layers; DeepSeek-V3's dense + MoE stacks are probed with one block each; other
    models of several stacks (FLUX: depth double + depth_single_blocks single blocks, of different
    sizes) are sharded whole (meta: cheap). A stack of blocks of different parameters (Qwen 3.5) is
    probed with one period of its kinds (`_block_period`), each block times n_layers / period."""
    n_layers = args.n_layers
    dense_moe = len(prefixes) == 2 and hasattr(args, "n_dense_layers")
    probe = probe and (len(prefixes) == 1 or dense_moe)
    period = _block_period(args)
    if probe and period:  # one block times n_layers would miss the other kind: one period of them
        probe_args = dataclasses.replace(args, n_layers=period)
        return True, probe_args, {prefixes[0]: n_layers}
    if probe and period is None:  # mixed blocks that do not repeat evenly: the whole stack
        probe = False
    if probe and dense_moe:
        probe_args = dataclasses.replace(args, n_layers=2, n_dense_layers=1)
        stack_lengths = {prefixes[0]: args.n_dense_layers, prefixes[1]: n_layers - args.n_dense_layers}
    else:
        probe_args = dataclasses.replace(args, n_layers=1) if probe else args
        stack_lengths = {prefixes[0]: n_layers} if probe else {}
    return probe, probe_args, stack_lengths


@dataclass
class _ParamTally:
    """Rank 0's parameter elements of a sharded model, outside the stacks (root) and per block."""

    root_numel: int = 0
    root_gathered: dict[str, int] = field(default_factory=dict)
    root_local: dict[str, int] = field(default_factory=dict)
    block_local: dict[str, int] = field(default_factory=dict)
    block_gathered: dict[str, int] = field(default_factory=dict)
    largest: int = 0
    """The largest gathered block parameter."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Local shapes of the root parameters and of the first block of each stack."""
    first_block: str | None = None
    muon_root: int = 0
    muon_block: dict[str, int] = field(default_factory=dict)
    muon_params: list[tuple[torch.Tensor, str | None]] = field(default_factory=list)
    """Muon's parameters, each with its stack's prefix (None outside the stacks)."""


def _tally_params(model: nn.Module, prefixes: tuple[str, ...], muon_ids: set[int]) -> _ParamTally:
    """Count each parameter's local and gathered elements into the root or its block
    ("layers.0", "single_blocks.3"), and Muon's share."""
    t = _ParamTally()
    for name, param in model.named_parameters():
        local = local_tensor(param)
        muon = id(param) in muon_ids
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if muon:
            t.muon_params.append((param, prefix))
        if prefix is not None:
            block = prefix + name[len(prefix) :].split(".")[0]  # "layers.0", "single_blocks.3"
            t.first_block = t.first_block or block
            t.block_local[block] = t.block_local.get(block, 0) + local.numel()
            t.block_gathered[block] = t.block_gathered.get(block, 0) + _gathered_numel(param)
            t.largest = max(t.largest, _gathered_numel(param))
            if muon:
                t.muon_block[block] = t.muon_block.get(block, 0) + local.numel()
            if block.endswith(".0"):  # the first block of each stack
                t.shapes[name] = tuple(local.shape)
        else:
            t.root_numel += local.numel()
            t.root_local[name] = local.numel()
            t.root_gathered[name] = _gathered_numel(param)
            t.shapes[name] = tuple(local.shape)
            if muon:
                t.muon_root += local.numel()
    return t


def _linear_shapes(model: nn.Module, prefixes: tuple[str, ...]) -> dict[str, tuple]:
    """(local, gathered) weight shapes of the root's linears and of the first block's of each stack."""
    return {
        name: (tuple(m.weight.shape), _gathered_shape(m.weight))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and (not any(name.startswith(p) for p in prefixes) or any(name.startswith(f"{p}0.") for p in prefixes))
    }


def _muon_whole_numel(param: torch.Tensor, stack_length: int) -> int:
    """Whole-matrix elements this rank holds in Muon's graph update of `param` (stacked
    `stack_length` layers deep): see `ShardStats.muon_whole_numel`. A matrix dim split by a
    _StridedShard (TP x SimpleFSDP on one dim, which graph-mode Muon refuses) counts as gathered."""
    from torch.distributed.tensor import DTensor, Shard

    m, n = param.shape[-2:]
    matrices = stack_length * math.prod(local_tensor(param).shape[:-2])
    spread = 1
    if isinstance(param, DTensor):
        for axis, placement in enumerate(param.placements):
            if isinstance(placement, Shard) and placement.dim >= param.dim() - 2:
                if type(placement) is not Shard:
                    return stack_length * math.prod(param.shape[:-2]) * m * n
                spread = max(spread, param.device_mesh.size(axis))
    return -(-matrices // spread) * m * n


def root_roles(family: ModelFamily) -> dict[str, str]:
    """Root module path -> "embedding" (the token table) or "output" (the LM head).

    The plan's TP styles say it. A plan with no TP styles at all (a family that refuses TP,
    Qwen 3.5 and DeepSeek-V4, whose `Decoder`s have the table and head every decoder has) gets the
    decoder layout's names (`models.common.plan.DECODER_TP`: `tok_embeddings`, `output`). Until
    2026-12-07 such a plan named neither, so its LM head counted 0 in the loss backward and its
    embedding table as a kept bf16 copy (Qwen 3.5 9B: 0.12 GiB of loss transient for 5.8).
    """
    from models.common.plan import DECODER_TP

    styles = family.plan.tp if family.plan.tp else DECODER_TP
    return {path: style for path, style in styles.items() if style in ("embedding", "output")}


def _lm_head_and_kept(family: ModelFamily, root_gathered: dict[str, int]) -> tuple[int, int]:
    """(LM head, root parameters whose bf16 copies the backward keeps), in gathered elements.

    The plan's roles (`root_roles`) say which root module is which: "output" is the LM head and
    "embedding" the token table, a lookup whose weight the backward does not keep. With tied
    weights `named_parameters` lists the table once, under the embedding, and it is the LM head
    too. A plan that names neither: every root parameter is kept and the LM head is not known (0).
    """
    by_module: dict[str, int] = {}
    for name, numel in root_gathered.items():
        module = name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + numel
    roles = root_roles(family)
    styled = lambda style: sum(by_module.get(p, 0) for p, s in roles.items() if s == style)  # noqa: E731
    embedding, output = styled("embedding"), styled("output")
    tied = output == 0
    head = embedding if tied else output
    kept = sum(by_module.values()) - (0 if tied else embedding)
    return head, kept
