"""Activation rematerialization inside the one-graph train step.

The graph step is a single forward-loss-backward(-update) graph: AOTAutograd traces
`torch.autograd.grad` inline, so no partitioner decides what the backward keeps. Two
mechanisms give the `[activation_checkpoint] mode` its meaning there:

- Unrolled blocks: the blocks run under `parallelisms.activation_checkpoint.checkpoint_fn`,
  which tags every op of a block with a recompute policy (`node.meta["recompute"]`).
  `remat_pass` then copies each tagged forward op that a backward op needs into the backward,
  right before its first use there, and dead-code elimination drops the forward copy's
  extra lifetime. It is our own version of torch's built-in pass (which we switch off) with
  two differences the trainer needs: several backward regions (one per micro-batch of
  gradient accumulation), and attention kernels tagged as random ops are recomputed when
  their `dropout_p` is 0 (deterministic), which is always the case in our models.
- Scanned blocks: the scan's own autograd builds the forward/backward bodies with the
  min-cut partitioner, and the checkpoint tags do not reach it (torch 2.13 retraces the body
  without node metadata). `scan_remat(mode)` tags the body's joint graph with the same
  policy right before that partitioner runs: `full` marks every forward op
  MUST_RECOMPUTE (the scan saves only each layer's inputs), `full_save_attention` the same
  but the attention kernels MUST_SAVE (the scan also stacks their outputs), `selective` applies
  `parallelisms.activation_checkpoint.sac_policy` op by op. In every mode (`none`
  included), ops on the layer's parameters alone (casts, transposes, SimpleFSDP
  all-gathers) are recomputed, so the scan never stacks a copy of the (gathered) weights
  for the backward.

On an XLA backend (torch-tpu, the XLA tier) the recomputed copies are identical to the forward
ops on the same values, so XLA's common-subexpression elimination merges them back and
checkpointing silently does nothing: the deviceless v6e compile of the captured Llama 3 8B step
gave the same FLOPs, HBM bytes and temporaries with `mode = "full"` as with `"none"`
(docs/tpu.md). torch-tpu fences recomputation only in separate backward graphs, and the step is
one graph. `remat_pass(gm, fence=True)` routes the forward values that each group of copies
reads through one `titan::optimization_barrier` (identity; `stablehlo.optimization_barrier` on
XLA), as `jax.checkpoint(prevent_cse=True)` does, so the copies compute on values XLA cannot
prove equal to the forward's. Scan bodies need no fence: their forward and backward are
different loops.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from models.errors import ConfigError

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)

_BARRIER_LIB = torch.library.Library("titan", "FRAGMENT")  # noqa: TOR901 (module lifetime)
_BARRIER_LIB.define("optimization_barrier(Tensor[] xs) -> Tensor[]")


@torch.library.impl(_BARRIER_LIB, "optimization_barrier", "CompositeExplicitAutograd")
def _barrier_identity(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    # Identity on every backend but XLA's; a custom op may not return its inputs, so copies.
    return [x.clone() for x in xs]


@torch.library.register_fake("titan::optimization_barrier", lib=_BARRIER_LIB)
def _barrier_fake(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


OPTIMIZATION_BARRIER = torch.ops.titan.optimization_barrier.default
"""Values in, the same values out; XLA may not look through it (no CSE, no reordering across)."""


def _must_recompute(node: fx.Node) -> bool:
    return node.meta.get("recompute") in _RECOMPUTE


def _is_backward(node: fx.Node) -> bool:
    # Dynamo marks what it traces from torch.autograd.grad; AOTAutograd carries it to ATen.
    return bool(node.meta.get("autograd_backward", False))


def _dropout_p(node: fx.Node) -> float | None:
    """The `dropout_p` argument of an attention op, or None if it has none."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return node.kwargs[arg.name]
            if i < len(node.args):
                return node.args[i]
            return arg.default_value
    return None


def _check_rng(nodes: list[fx.Node]) -> None:
    for node in nodes:
        if node.op != "call_function" or not _must_recompute(node):
            continue
        if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
            continue
        p = _dropout_p(node)
        if p is None or p != 0:
            raise ConfigError(
                f"activation_checkpoint.mode: graph mode cannot recompute the random op "
                f"{node.target} (dropout/RNG in a checkpointed block); allowed: none"
            )


def _backward_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The backward ops: those autograd.grad traced (`_is_backward`) and those reading a backward
    value. Some ops of a backward lack the mark (the Qwen 3 MoE step's have three single `mul`s
    between its marked ops): taken for forward ops, they split one backward into several regions,
    each recomputing again what the previous one had recomputed (the attention forward three
    times per block instead of two), and made the forward values they read region outputs."""
    backward: set[fx.Node] = set()
    for node in nodes:
        if _is_backward(node) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def _normalize_tags(nodes: list[fx.Node], in_backward: set[fx.Node]) -> None:
    """Keep what leaves a checkpointed region in the forward; recompute only its inside.

    A tagged node read by a forward node that is not in its own region (the next block, the
    final norm, the loss) is a region output: eager checkpointing returns it to the caller,
    so it stays materialized here too (MUST_SAVE) instead of being recomputed in backward.
    """
    for node in nodes:
        if not _must_recompute(node) or node in in_backward:
            continue
        region = node.meta.get("ac_graph_id")
        for user in node.users:
            if user in in_backward or user.op == "output":
                continue
            # A user in the region that is itself saved (selective AC's matmuls, the attention
            # kernel of full_save_attention) does not make its input an output: as in eager,
            # the input is recomputed for that op's backward (q, k, v for the attention's).
            if user.meta.get("recompute") is None or user.meta.get("ac_graph_id") != region:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                break


def remat_pass(gm: fx.GraphModule, *, fence: bool = False) -> int:
    """Recompute tagged forward ops in the backward; return the number of ops copied.
    `fence`: pass the forward values each group of copies reads through an optimization barrier
    (XLA backends; module docstring)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    if not any(_must_recompute(n) for n in nodes):
        return 0
    _check_rng(nodes)
    in_backward = _backward_nodes(nodes)
    _normalize_tags(nodes, in_backward)

    copied = 0
    recomputed: dict[fx.Node, fx.Node] = {}
    groups: list[list[fx.Node]] = []  # the copies made for one backward op, in graph order
    consumers: list[fx.Node] = []  # that backward op
    previous_backward = False
    for node in nodes:
        backward = node in in_backward
        if backward and not previous_backward:
            # A new backward region (one per autograd.grad call, i.e. per micro-batch):
            # copies from an earlier region are not reused, their lifetime ended there.
            recomputed = {}
        previous_backward = backward
        if not backward:
            continue

        def materialize(dep: fx.Node, before: fx.Node) -> fx.Node:
            nonlocal copied
            if dep in recomputed:
                return recomputed[dep]
            if dep.op != "call_function" or dep in in_backward or not _must_recompute(dep):
                return dep
            args_map = {a: materialize(a, before) for a in dep.all_input_nodes}
            with graph.inserting_before(before):
                dup = graph.node_copy(dep, lambda a: args_map.get(a, a))
            # Through the graph's namespace: one op recomputed in two backward regions gets two
            # names (a fixed name failed graph.lint() on the unrolled EP MoE step).
            dup._rename(f"{dep.name}_recomputed")
            dup.meta = {**dep.meta, "autograd_backward": True}
            recomputed[dep] = dup
            copied += 1
            groups[-1].append(dup)
            return dup

        groups.append([])
        consumers.append(node)
        for dep in list(node.all_input_nodes):
            new = materialize(dep, node)
            if new is not dep:
                node.replace_input_with(dep, new)
    if fence:
        for group, consumer in zip(groups, consumers):
            if group:
                _fence(graph, group, consumer, in_backward)
    graph.eliminate_dead_code()
    gm.recompile()
    return copied


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _backward_ties(consumer: fx.Node, in_backward: set[fx.Node]) -> list[fx.Node]:
    """Backward values that exist right before `consumer` runs: the backward tensors it reads
    (its incoming cotangent), else the nearest backward tensor before it in graph order."""
    ties = [a for a in consumer.all_input_nodes if a in in_backward and _is_tensor(a)]
    node = consumer.prev
    while not ties and node.op != "root":
        if node in in_backward and _is_tensor(node):
            ties = [node]
        node = node.prev
    return ties


def _fence(graph: fx.Graph, group: list[fx.Node], consumer: fx.Node, in_backward: set[fx.Node]) -> None:
    """Route the tensors that `group` (recomputed ops, in graph order, made for the backward op
    `consumer`) reads from outside the group through one optimization barrier placed before the
    first copy, together with the backward values `consumer` reads (its incoming cotangent).

    The barrier on forward values alone stops XLA's CSE but not its scheduler: nothing then ties
    the recomputation to the backward, and in a program without a layer scan XLA may run it right
    after the forward and keep its outputs alive until the backward, which is the memory of no
    checkpointing (issue 54). JAX's remat puts the incoming cotangents through the same barrier
    (`remat_transpose`: the transposed remat's operands are the residuals and the cotangents, and
    its lowering fences them together); so does this one, and `consumer` reads the cotangent
    through the barrier too: the copies can start only once the backward has reached them.
    `in_backward`: the backward ops (`_backward_nodes`)."""
    inside = set(group)
    outside: list[fx.Node] = []
    for dup in group:
        for arg in dup.all_input_nodes:
            # constants (get_attr) need no fence: an op that also reads a fenced value is not CSE'd
            if arg not in inside and arg not in outside and arg.op != "get_attr" and _is_tensor(arg):
                outside.append(arg)
    if not outside:
        return
    # A group on graph inputs alone (a parameter's cast and SimpleFSDP all-gather, gathered
    # again for the backward) is not tied: `prefetch_all_gathers_pass` issues those gathers
    # ahead of their use on purpose, and their recomputation is not an activation.
    tied = any(a.op != "placeholder" for a in outside)
    ties = _backward_ties(consumer, in_backward) if tied else []
    fenced_args = outside + ties
    with graph.inserting_before(group[0]):
        barrier = graph.call_function(OPTIMIZATION_BARRIER, (fenced_args,))
        barrier.meta = {"val": [a.meta["val"] for a in fenced_args], "autograd_backward": True}
        fenced = []
        for i, arg in enumerate(fenced_args):
            item = graph.call_function(operator.getitem, (barrier, i))
            item.meta = {"val": arg.meta["val"], "autograd_backward": True}
            fenced.append(item)
    for dup in group:
        for arg, item in zip(outside, fenced):
            dup.replace_input_with(arg, item)
    for tie, item in zip(ties, fenced[len(outside) :]):
        if tie in consumer.all_input_nodes:
            consumer.replace_input_with(tie, item)


def _tag_joint_forward(joint: fx.GraphModule, mode: str) -> None:
    """Tag the forward ops of a scan body's joint graph with recompute policies.

    Ops computed from the layer's parameter row alone (casts, transposes, SimpleFSDP's
    all-gathers) are always recomputed: otherwise the partitioner stacks a copy of every
    layer's (gathered) weights for the backward. The ops on activations follow `mode`.
    """
    from parallelisms.activation_checkpoint import FULL_MODES, is_attention_op, sac_policy

    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    # BlockStack's scan has one carry, the hidden state: the body's first input.
    carry = placeholders[0]
    backward: set[fx.Node] = set()  # depends on a tangent (an incoming gradient)
    on_carry: set[fx.Node] = {carry}
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
            continue
        inputs = node.all_input_nodes
        if any(a in backward for a in inputs):
            backward.add(node)
        if any(a in on_carry for a in inputs):
            on_carry.add(node)
    for node in joint.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        if node not in on_carry:
            policy = CheckpointPolicy.MUST_RECOMPUTE
        elif mode == "none":
            policy = None
        elif node.target is operator.getitem:
            # An output of a multi-output op (attention returns out + logsumexp) follows its op.
            policy = node.args[0].meta.get("recompute")
        elif mode == "full_save_attention" and is_attention_op(node.target):
            policy = CheckpointPolicy.MUST_SAVE  # the scan stacks (out, lse) for the backward
        elif torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            # Attention kernels are tagged random (dropout). The partitioner cannot recompute
            # random ops inside a scan body on torch 2.13 (its RNG functionalization fails),
            # so they are left to it untagged: it saves them, being compute-intensive.
            policy = None
        elif mode in FULL_MODES:
            policy = CheckpointPolicy.MUST_RECOMPUTE
        else:
            policy = sac_policy(None, node.target)
        if policy is None:
            continue
        node.meta["recompute"] = policy
        # One region per body: the partitioner treats tagged neighbours as one block.
        node.meta["ac_graph_id"] = 0


@contextlib.contextmanager
def scan_remat(mode: str) -> Iterator[None]:
    """While capturing, apply `mode` to the partition of every scan body's forward/backward.

    torch's scan autograd calls `torch._functorch.partitioners.min_cut_rematerialization_partition`
    (looked up at call time) on the body's joint graph; during capture we route it through a
    wrapper that tags the graph first. The main step graph never reaches that partitioner (it is
    an inference graph: the backward is traced inline), so only scan bodies are affected.
    """
    import torch._functorch.partitioners as partitioners

    original = partitioners.min_cut_rematerialization_partition

    def tagged_partition(joint_module: fx.GraphModule, *args, **kwargs):
        _tag_joint_forward(joint_module, mode)
        return original(joint_module, *args, **kwargs)

    partitioners.min_cut_rematerialization_partition = tagged_partition
    try:
        yield
    finally:
        partitioners.min_cut_rematerialization_partition = original
