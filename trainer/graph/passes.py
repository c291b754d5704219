"""Passes over the captured ATen graph of the train step, run before it is compiled.

The pipeline (`run_passes`) is short and every pass does real work:
1. `remat` (trainer/graph/remat.py): recompute checkpoint-tagged forward ops in backward.
2. `scan_transpose_view`: in scan bodies, matmuls read transposed weight views instead of
   the transposed copies torch's functionalization of the body puts there.
3. `scan_reverse` (Inductor): backward scans run as loops that index in reverse instead
   of over flipped copies of the weights and saved activations; for torch-tpu
   `tag_reverse_scans` keeps the scan op, drops the flips and tags the body for its reverse
   lowering.
   `offload_block_inputs` (`[activation_checkpoint] offload = "block_inputs"`, before the
   reverse passes): the block inputs a forward scan stacks for its backward scan go to the
   host row by row (`ao.offload` in the forward body, `ao.reload` in the backward's).
4. `gloo_reduce_scatter` (gloo groups): reduce-scatters as all-to-alls + a local sum, the
   gradient on the wire in its dtype before the up-cast to the reduce dtype.
5. `prefetch_all_gathers`: SimpleFSDP's all-gathers are issued `ALL_GATHER_LOOKAHEAD` gathers
   ahead of their use, so they run while the step computes and a rank that falls slightly
   behind does not stall the others at every parameter.
6. `dce`: dead-code elimination (e.g. forward values nothing reads after remat, unused
   outputs of the optimizer's bookkeeping).
7. `stats` (`graph_stats`): counts nodes, ops, collectives, scans and the bytes the forward
   scans stack for the backward (the per-layer activation memory with layer scan). It does
   not change the graph; its numbers go to the dump, the metrics and the tests.

`graph_text` renders a graph for the dump (`[compile] dump_graph`) and `normalized_graph_text`
strips what changes without the graph changing (source locations, object addresses) for
the golden test.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import fx

from trainer.graph.remat import remat_pass
from trainer.step.plan import AC_OFFLOADS

_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_reduce_coalesced",
)
_MATMULS = ("mm", "addmm", "bmm", "_grouped_mm")


@dataclass
class GraphStats:
    """What one captured step graph contains."""

    nodes: int = 0
    """Nodes of the top-level graph (placeholders and output included)."""
    nodes_total: int = 0
    """Nodes including the bodies of scans (and other subgraphs)."""
    placeholders: int = 0
    ops: Counter = field(default_factory=Counter)
    """call_function targets of the top-level graph and subgraphs, by short name."""
    collectives: Counter = field(default_factory=Counter)
    scans: int = 0
    scan_saved_bytes: int = 0
    """Bytes of the per-layer values the forward scans stack for the backward."""
    matmuls: int = 0
    recomputed: int = 0
    """Forward ops the remat pass copied into the backward."""
    prefetched_gathers: int = 0
    """All-gathers `prefetch_all_gathers_pass` issued ahead of their use."""
    input_mutations: int = 0
    """In-place `copy_` writes back into inputs (parameters, optimizer state)."""
    scan_offloaded_bytes: int = 0
    """Bytes of `scan_saved_bytes` the forward scans stack in host memory (`ao.offload` rows:
    `offload_block_inputs_pass`)."""

    def summary(self) -> str:
        coll = ", ".join(f"{k} {v}" for k, v in sorted(self.collectives.items())) or "none"
        offloaded = f", {self.scan_offloaded_bytes / 2**20:.2f} MiB on the host" if self.scan_offloaded_bytes else ""
        return (
            f"nodes {self.nodes} (with subgraphs {self.nodes_total}), placeholders {self.placeholders}, "
            f"scans {self.scans} (saved {self.scan_saved_bytes / 2**20:.2f} MiB{offloaded}), matmuls {self.matmuls}, "
            f"recomputed {self.recomputed}, prefetched gathers {self.prefetched_gathers}, input mutations {self.input_mutations}, collectives: {coll}"
        )


def _short(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(val.shape) * val.element_size()
    return 0


def _subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, fx.GraphModule):
                out.append(sub)
    return out


def graph_stats(gm: fx.GraphModule, *, recomputed: int = 0) -> GraphStats:
    """Count what is in `gm` (and its subgraphs)."""
    stats = GraphStats(recomputed=recomputed)
    stats.nodes = len(gm.graph.nodes)

    def visit(g: fx.GraphModule, top: bool) -> None:
        stats.nodes_total += len(g.graph.nodes)
        for node in g.graph.nodes:
            if node.op == "placeholder" and top:
                stats.placeholders += 1
            if node.op != "call_function":
                continue
            name = _short(node.target)
            stats.ops[name] += 1
            if name in _COLLECTIVES:
                stats.collectives[name] += 1
            if name in _MATMULS:
                stats.matmuls += 1
            if top and name == "copy_":
                stats.input_mutations += 1
            if name == "while_loop" and top:
                stats.scans += 1  # a backward scan lowered by scan_reverse_pass
            if name == "scan":
                stats.scans += 1
                if top and not node.meta.get("autograd_backward", False):
                    # Outputs: the final carries, then the stacked per-step values; in a
                    # forward scan those are what its backward reads.
                    vals = node.meta.get("val") or ()
                    n_carry = len(node.args[1])
                    stats.scan_saved_bytes += sum(_bytes(v) for v in list(vals)[n_carry:])
                    body = getattr(g, node.args[0].target, None)
                    outs = body.graph.output_node().args[0] if isinstance(body, fx.GraphModule) else ()
                    stats.scan_offloaded_bytes += sum(
                        _bytes(v)
                        for v, o in zip(list(vals)[n_carry:], list(outs)[n_carry:])
                        if isinstance(o, fx.Node) and _is_ao(o, "offload")
                    )
        for sub in _subgraphs(g):
            visit(sub, False)

    visit(gm, True)
    return stats


def dce_pass(gm: fx.GraphModule) -> int:
    """Remove nodes whose results nobody reads; return how many went."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return before - len(gm.graph.nodes)


_MATMUL_TARGETS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int)


def scan_transpose_view_pass(gm: fx.GraphModule) -> int:
    """In scan bodies, feed matmuls transposed views of the weights instead of transposed copies.

    torch 2.13 functionalizes a scan body with every view turned into a copy: `t_copy`, or,
    after Inductor's decompositions, `clone(permute(w))`. So each layer's weights are copied
    before every matmul, forward and backward. Matmul kernels take transposed operands as
    they are, so a transpose copy read only by matmuls (or by further such copies) becomes a
    view. Body outputs are never touched (scan forbids outputs aliasing inputs). Returns the
    number of copies removed.
    """
    changed = 0
    for sub in _subgraphs(gm):
        graph = sub.graph
        as_view: set[fx.Node] = set()
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function" or not node.users:
                continue
            if not all(u.target in _MATMUL_TARGETS or u in as_view for u in node.users):
                continue
            if node.target is torch.ops.aten.t_copy.default:
                as_view.add(node)
            elif (
                node.target is torch.ops.aten.clone.default
                and isinstance(node.args[0], fx.Node)
                and node.args[0].target in _TRANSPOSES
            ):
                as_view.add(node)
        for node in as_view:
            if node.target is torch.ops.aten.t_copy.default:
                node.target = torch.ops.aten.t.default
            else:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        if as_view:
            sub.recompile()
            changed += len(as_view)
    return changed


_FLIP = torch.ops.aten.flip.default
# Under Inductor the graph reaches the passes after its decompositions, which turn `flip` into
# `prims.rev` (same arguments); aot_eager keeps `aten.flip`.
_FLIPS = (_FLIP, torch.ops.prims.rev.default)


def _is_flip0(node) -> bool:
    return (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target in _FLIPS and list(node.args[1]) == [0]
    )


def scan_reverse_pass(gm: fx.GraphModule, *, decompositions: dict | None = None) -> int:
    """Run the backward scans as loops that index in reverse, without flipped copies.

    torch 2.13 builds a scan's backward as a forward scan over `flip`ped copies of everything
    it reads per layer (the stacked weights, every activation the forward saved) and flips the
    per-layer gradients it stacks back: per step one extra copy of the saved activations and two
    of the block weights. Here each top-level scan whose `xs` are all `flip(x, [0])` becomes a
    `while_loop` over i = 0..n-1 that reads row n-1-i of the unflipped `x` (a view) and writes
    its per-step outputs into row n-1-i of preallocated buffers, so they come out in layer
    order and the flips after the scan go too. That is the lowering Inductor gives every scan
    anyway (`decompose_scan_to_while_loop`: a host loop over preallocated outputs) with the
    index reversed: the same ops on the same values in the same order, so results are bitwise
    those of the flipped scan. Only for Inductor (`CaptureBackend.reverse_scans`); the
    XLA tier needs the scan op itself. `decompositions`: the table the graph was traced with
    (Inductor's: the loop is traced into a graph that has been through its decompositions, and
    Inductor will not lower ops it decomposes). Returns the number of scans rewritten.
    """
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops.scan import _extract_carry_and_out
    from torch.fx.experimental.proxy_tensor import make_fx

    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)):
        combine, init, xs, additional = node.args
        if not xs or not all(_is_flip0(x) for x in xs):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        flip_op = xs[0].target  # aten.flip or prims.rev, whichever the graph uses
        body: fx.GraphModule = getattr(gm, combine.target)
        n_carry, n_xs = len(init), len(xs)
        ys_vals = list(node.meta["val"])[n_carry:]
        inputs = [*init, *[x.args[0] for x in xs], *additional]
        fake_inputs = [a.meta["val"] if isinstance(a, fx.Node) else a for a in inputs]
        traced = make_fx(
            _reversed_loop(body, n_carry, n_xs, ys_vals, _extract_carry_and_out),
            decomposition_table=decompositions,
            tracing_mode="real",
        )
        with detect_fake_mode(fake_inputs):
            loop_gm = traced(*fake_inputs)
        outs = _inline(gm, loop_gm, inputs, before=node)
        for item in list(node.users):
            k = item.args[1]
            if k < n_carry:
                item.replace_all_uses_with(outs[k])
            else:
                for user in list(item.users):
                    if _is_flip0(user):  # flip(reversed stack) == the stack in layer order
                        user.replace_all_uses_with(outs[k])
                        gm.graph.erase_node(user)
                if item.users:  # anything else still wants the reversed order
                    with gm.graph.inserting_after(outs[k]):
                        flip = gm.graph.call_function(flip_op, (outs[k], [0]))
                    flip.meta["val"] = item.meta["val"]
                    item.replace_all_uses_with(flip)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done


def _reversed_loop(body, n_carry: int, n_xs: int, ys_vals: list, extract):
    """`fn(*init, *xs, *additional)` -> `[*carry, *ys]`: `body` over the rows of `xs` from the
    last to the first; `ys[k]` is the output of row k (layer order)."""

    def fn(*flat):
        init, xs, additional = flat[:n_carry], flat[n_carry : n_carry + n_xs], flat[n_carry + n_xs :]
        length = xs[0].size(0)
        n_ys = len(ys_vals)
        bufs = [torch.empty_strided(y.size(), y.stride(), dtype=y.dtype, device=y.device) for y in ys_vals]

        def cond_fn(i, *rest):
            return i < length

        def body_fn(i, *rest):
            ys_out, carry = rest[:n_ys], rest[n_ys : n_ys + n_carry]
            xs_in, add_in = rest[n_ys + n_carry : n_ys + n_carry + n_xs], rest[n_ys + n_carry + n_xs :]
            row = length - 1 - i.item()
            torch._check(row >= 0)
            torch._check(row < length)
            next_carry, ys = extract(body(*carry, *[x.select(0, row) for x in xs_in], *add_in), n_carry)
            for buf, y in zip(ys_out, ys):
                buf.select(0, row).copy_(y)
            return (i + 1, *ys_out, *next_carry)

        # The loop counter lives on the host (as in Inductor's lowering): `.item()` is free.
        out = torch.ops.higher_order.while_loop(
            cond_fn, body_fn, (torch.zeros([], dtype=torch.int64), *bufs, *init), (*xs, *additional)
        )
        return [*out[1 + n_ys :], *out[1 : 1 + n_ys]]

    return fn


def _inline(gm: fx.GraphModule, sub: fx.GraphModule, inputs: list, *, before: fx.Node) -> list:
    """Copy `sub`'s nodes into `gm` before `before`, its placeholders bound to `inputs`;
    return the nodes of its (flat) output."""
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs)
    env.update(zip(placeholders, inputs))
    outs = None
    with gm.graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = [env[o] for o in n.args[0]]
            elif n.op == "get_attr":
                name = _fresh_attr(gm, f"reverse_{n.target}")
                gm.register_module(name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta.update(n.meta)
            else:
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
    assert outs is not None
    return outs


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


SCAN_REVERSE_ANNOTATION = "torch_tpu_scan_reverse"
"""The `node.meta["custom"]` key torch-tpu 0.2.0 reads on a scan body's nodes: when any node of
the body carries it, torch-tpu lowers the scan as a reverse loop (`ScanDirection.kReverse`:
step i reads row n-1-i of every `xs` and writes row n-1-i of every stacked output;
torch_tpu/_internal/compile/scan.py, `SCAN_REVERSE_ANNOTATION`, `_body_asks_for_reverse`).
Other backends (CPU, CUDA, Inductor, torchax unless told: tools/xla_lowering.py) ignore it and
scan forward, so a graph rewritten by `tag_reverse_scans` is only right where it is honoured."""


def scan_is_reversed(body: fx.GraphModule) -> bool:
    """Whether a scan with this body runs from the last row to the first (the annotation of
    `SCAN_REVERSE_ANNOTATION` on any of its nodes, as torch-tpu decides it)."""
    return any(n.meta.get("custom", {}).get(SCAN_REVERSE_ANNOTATION, False) for n in body.graph.nodes)


def tag_reverse_scans(gm: fx.GraphModule) -> int:
    """Backward scans without flipped copies, for torch-tpu: drop the flips, tag the body reverse.

    torch 2.13 builds a scan's backward as a forward scan over `flip(x, [0])` of every stacked
    tensor it reads (saved activations, stacked weights, the stacked output gradients) and flips
    the per-layer gradients it stacks back into layer order: on XLA each flip is a full copy,
    the saved-activation one live at the start of the backward (docs/graph_trainer.md). For each
    top-level scan whose `xs` are all `flip(x, [0])`, this pass

    - feeds the scan the unflipped `x` (the flips die unless something else reads them);
    - tags every node of its body (and the scan node) with `meta["custom"][SCAN_REVERSE_ANNOTATION]
      = True`, so torch-tpu runs it from row n-1 to row 0: step i of the reverse loop reads
      row n-1-i of `x`, which is row i of `flip(x)`, what step i of the flipped scan read, so
      the carries are the same values computed in the same order;
    - fixes up the stacked outputs: the flipped scan wrote the output of step i to row i, i.e.
      layer n-1-i's gradient, so its stacks come out in reverse layer order and the graph flips
      them back; the reverse loop writes the output of step i to row n-1-i, i.e. its stacks are
      already in layer order. So `flip(stack, [0])` nodes are replaced by the stack itself, and
      any other reader of a stack (none in torch 2.13's graphs) gets a `flip` inserted, as it
      wants the reverse order.

    A body that another scan also uses is copied before it is tagged. Works on the joint graph
    after AOT (where setting the meta directly survives; the annotation set by tracing did not
    reach the autograd-generated backward body: reference/torch_tpu.md §2.4). Only for graphs that
    torch-tpu lowers (`CaptureBackend` with backend `tpu`; scripts/estimate_xla.py with the torchax
    lowering in tools/xla_lowering.py, which honours the tag). Returns the number of scans tagged.
    """
    scans = list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan))
    body_uses = Counter(n.args[0].target for n in scans)
    done = 0
    for node in scans:
        combine, init, xs, additional = node.args
        if not xs or not all(_is_flip0(x) for x in xs):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        flips, old_combine = list(xs), combine
        flip_op = flips[0].target
        body: fx.GraphModule = getattr(gm, combine.target)
        if body_uses[combine.target] > 1:  # shared with a forward scan: tag a copy only
            import copy

            name = _fresh_attr(gm, f"{combine.target}_reverse")
            gm.register_module(name, copy.deepcopy(body))
            body_uses[combine.target] -= 1
            with gm.graph.inserting_before(node):
                combine = gm.graph.get_attr(name)
            combine.meta.update(old_combine.meta)
            body = getattr(gm, name)
        for n in (*body.graph.nodes, node):
            # A new dict: tracing shares one `custom` dict among many nodes (spmd_safe's).
            n.meta["custom"] = {**n.meta.get("custom", {}), SCAN_REVERSE_ANNOTATION: True}
        node.args = (combine, init, [x.args[0] for x in flips], additional)
        n_carry = len(init)
        for item in list(node.users):
            if item.args[1] < n_carry:
                continue
            unflips = [u for u in item.users if _is_flip0(u)]
            readers = [u for u in item.users if u not in unflips]
            for unflip in unflips:  # flip(the stack) wanted layer order: the stack now is
                unflip.replace_all_uses_with(item)
                gm.graph.erase_node(unflip)
            if readers:  # readers of the reversed order: give them the reversed order
                with gm.graph.inserting_after(item):
                    flip = gm.graph.call_function(flip_op, (item, [0]))
                flip.meta["val"] = item.meta["val"]
                for reader in readers:
                    reader.replace_input_with(item, flip)
        for dead in dict.fromkeys([*flips, old_combine]):
            if not dead.users:
                gm.graph.erase_node(dead)
        done += 1
    if done:
        gm.recompile()
    return done


@functools.cache
def host_offload_ops():
    """torch's activation-offloading ops (`torch.ops.ao.offload` / `reload`, registered on import
    of torch/_functorch/_activation_offloading/offload_ops.py), with a CPU kernel each: upstream's
    kernels copy on an accelerator's transfer stream and raise "Accelerator expected" on a CPU
    tensor; here a CPU row is copied (the host copy is a plain copy: same values). Registered once
    per process (cached)."""
    from torch._functorch._activation_offloading import offload_ops

    offload_ops.offload.register_kernel("cpu")(lambda tensor: tensor.clone())
    offload_ops.reload.register_kernel("cpu")(lambda tensor, device: tensor.to(device, copy=True))
    return torch.ops.ao.offload.default, torch.ops.ao.reload.default


def _is_ao(node: fx.Node, name: str) -> bool:
    ao = getattr(torch.ops, "ao", None)
    op = getattr(ao, name, None) if ao is not None else None
    return node.op == "call_function" and op is not None and getattr(node.target, "_overloadpacket", None) == op


def offload_block_inputs_pass(gm: fx.GraphModule) -> int:
    """Keep the block inputs the forward scans save for their backward in host memory, row by row.

    With layer scan and full activation checkpointing, the forward scan's body emits its carry
    (the block's input) as a per-step output, `clone(carry)`, which the scan stacks into
    `[n_layers, ...]` for the backward scan (torch's scan autograd); that stack is the largest
    activation term. For each forward scan whose stacked block inputs only the backward scan
    reads (directly, or through torch 2.13's `flip`), this pass
    - wraps the emitted row in `ao.offload` inside the forward body (the stack is built on the host);
    - wraps the row the backward body reads in `ao.reload` (back to the compute device) before
      its uses. torch-tpu 0.2.0 keeps a scan-body operand that `ao.reload` reads in pinned host
      memory (torch_tpu/_internal/compile/scan.py `_pin_offloaded_body_args`); the TPU program
      compile (tools/tpu_compile_worker.py) lowers the pair to `jax.device_put` into the
      `pinned_host` memory space and back: MaxText's `decoder_layer_input=offload`.
    On the CPU both ops are copies (`host_offload_ops`), so the step's numbers do not change. On CUDA the
    pass leaves the graph alone (upstream's CUDA kernels are asynchronous and need `ao.wait_tensor`
    pairs, which this pass does not place). Run before
    `tag_reverse_scans` / `scan_reverse_pass`. A body another scan also uses is copied first.
    Returns the number of stacked outputs moved."""
    import copy

    offload, reload = host_offload_ops()
    scans = list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan))
    body_uses = Counter(n.args[0].target for n in scans)

    def own_body(node: fx.Node) -> fx.GraphModule:
        combine = node.args[0]
        if body_uses[combine.target] > 1:
            name = _fresh_attr(gm, f"{combine.target}_offload")
            gm.register_module(name, copy.deepcopy(getattr(gm, combine.target)))
            body_uses[combine.target] -= 1
            body_uses[name] += 1
            with gm.graph.inserting_before(node):
                fresh = gm.graph.get_attr(name)
            fresh.meta.update(combine.meta)
            node.args = (fresh, *node.args[1:])
            if not combine.users:
                gm.graph.erase_node(combine)
            return getattr(gm, name)
        return getattr(gm, combine.target)

    done = 0
    for fwd in scans:
        body = getattr(gm, fwd.args[0].target)
        n_carry = len(fwd.args[1])
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        outs = list(body.graph.output_node().args[0])
        rows = [
            j
            for j in range(n_carry, len(outs))
            if isinstance(outs[j], fx.Node)
            and outs[j].target is torch.ops.aten.clone.default
            and outs[j].args[0] in places[:n_carry]
            and getattr(outs[j].meta.get("val"), "device", torch.device("cpu")).type != "cuda"
        ]
        moves = []
        for j in rows:
            items = [u for u in fwd.users if u.target is operator.getitem and u.args[1] == j]
            readers = []  # (backward scan, index in its xs)
            for item in items:
                for user in item.users:
                    via = [user] if not _is_flip0(user) else list(user.users)
                    for bwd in via:
                        stacked = (item, user)
                        if (
                            bwd is fwd
                            or bwd.target is not torch.ops.higher_order.scan
                            or any(a in stacked for a in (*bwd.args[1], *bwd.args[3]))
                        ):
                            readers = None  # read whole, or by something other than a scan's xs
                            break
                        readers.extend((bwd, k) for k, x in enumerate(bwd.args[2]) if x in stacked)
                    if readers is None:
                        break
                if readers is None:
                    break
            if items and readers:
                moves.append((j, readers))
        if not moves:
            continue
        body = own_body(fwd)
        outs = list(body.graph.output_node().args[0])
        for j, readers in moves:
            row = outs[j]
            with body.graph.inserting_after(row):
                host = body.graph.call_function(offload, (row,))
            host.meta["val"] = row.meta.get("val")
            outs[j] = host
            for bwd, k in readers:
                bbody = own_body(bwd)
                slot = [n for n in bbody.graph.nodes if n.op == "placeholder"][len(bwd.args[1]) + k]
                if any(_is_ao(u, "reload") for u in slot.users):
                    continue
                val = slot.meta.get("val")
                with bbody.graph.inserting_after(slot):
                    dev = bbody.graph.call_function(
                        reload, (slot, val.device if val is not None else torch.device("cpu"))
                    )
                dev.meta["val"] = val
                slot.replace_all_uses_with(dev, delete_user_cb=lambda u, dev=dev: u is not dev)
                bbody.recompile()
            done += 1
        body.graph.output_node().args = (outs,)
        body.recompile()
    if done:
        gm.recompile()
    return done


ALL_GATHER_LOOKAHEAD = 8
"""All-gathers in flight ahead of the one the step waits for (`prefetch_all_gathers_pass`):
about one decoder block's parameters (a Llama block has 9)."""


def prefetch_all_gathers_pass(gm: fx.GraphModule, lookahead: int = ALL_GATHER_LOOKAHEAD) -> int:
    """Issue each top-level all-gather before the wait of the one `lookahead` places earlier.

    As traced, SimpleFSDP's all-gather of a parameter is issued just before its use, so every
    gather is a synchronization point at which the faster rank waits for the slower one. Here
    all-gather i (with the casts and views it reads, all pure ops on graph inputs) moves up to
    just before the wait of all-gather max(0, i - lookahead), after gather i - 1, so gathers are
    issued in their original order and up to lookahead + 1 are in flight: they run on the process
    group's thread while the step computes with earlier parameters, and a rank that falls
    behind by less than `lookahead` gathers does not stall the other. Waits stay where they
    are. Gathers inside scan bodies (layer scan) are not moved. Returns how many moved.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers = [n for n in graph.nodes if n.op == "call_function" and _short(n.target) == "all_gather_into_tensor"]
    waits = []
    for ag in gathers:
        users = [u for u in ag.users if _short(u.target) == "wait_tensor"]
        waits.append(min(users, key=order.__getitem__) if users else None)
    moved = 0
    for i in range(1, len(gathers)):
        target = waits[max(0, i - lookahead)]
        if target is None or order[gathers[i]] < order[target]:
            continue
        chain, ok, stack, seen = [], True, [gathers[i]], set()
        while stack and ok:
            node = stack.pop()
            if node in seen or order[node] < order[target]:
                continue
            seen.add(node)
            if node.op != "call_function" or (
                node is not gathers[i]
                and (node.is_impure() or _short(node.target) in _COLLECTIVES or _short(node.target) == "wait_tensor")
            ):
                ok = False
                break
            chain.append(node)
            stack.extend(node.all_input_nodes)
        if not ok:
            continue
        chain.sort(key=order.__getitem__)
        for node in chain:
            target.prepend(node)
        # Renumber only the moved nodes, into the gap before `target` (a full renumbering per
        # gather is quadratic in the graph's size). A gap takes at most lookahead + 1 chains,
        # so a float's 53 bits never run out.
        low, high = order[chain[0].prev], order[target]
        for j, node in enumerate(chain, 1):
            order[node] = low + (high - low) * j / (len(chain) + 1)
        moved += 1
    if moved:
        gm.recompile()
    return moved


def _on_gloo(group_name: str) -> bool:
    from torch.distributed.distributed_c10d import _resolve_process_group

    from trainer.runtime.device import GLOO_SERIAL

    try:
        group = _resolve_process_group(group_name)
    except (KeyError, ValueError, RuntimeError):
        return False
    return torch.distributed.get_backend(group) in ("gloo", GLOO_SERIAL)


def gloo_reduce_scatter_pass(gm: fx.GraphModule) -> int:
    """On gloo groups, reduce-scatter as an all-to-all and a local sum; returns how many.

    torch 2.13's gloo reduce-scatters by all-reducing the whole tensor and keeping this rank's
    part: each rank sends and receives 2 (R - 1) / R of the tensor on the process group's
    thread. An all-to-all hands each rank the R parts of its shard ((R - 1) / R of the tensor
    sent and received, once) and the sum of the parts runs in the step, where Inductor fuses it
    with what reads the gradient. When the reduced tensor is an up-cast (SimpleFSDP reduces a
    bf16 gradient in fp32: `reduce_dtype`), the parts travel in the narrow dtype and are summed
    in the wide one: the values are the same (the cast is exact), so the result is too, for
    half the bytes. Sum and mean only; with R > 2 the order of the sum may differ from gloo's.
    Applies in scan bodies too (a scanned layer reduces its gradient in the body). Measured on
    the debug recipe, 2 ranks on a 2-core VM: docs/parallelism.md ("CPU collectives").
    """
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    casts = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
    done = 0
    for g in [gm, *_subgraphs(gm)]:
        graph, done_before = g.graph, done
        for rs in list(graph.nodes):
            if rs.op != "call_function" or rs.target is not c10d.reduce_scatter_tensor.default:
                continue
            inp, op, size, name = rs.args[:4]
            waits = list(rs.users)
            if (
                op not in ("sum", "avg")
                or not _on_gloo(name)
                or len(waits) != 1
                or waits[0].target is not c10d.wait_tensor.default
            ):
                continue
            wait, val = waits[0], inp.meta["val"]
            src = inp
            if (
                inp.target in casts
                and set(inp.kwargs) <= {"dtype"}
                and val.dtype.is_floating_point
                and inp.args[0].meta["val"].dtype.is_floating_point
                and inp.args[0].meta["val"].dtype.itemsize < val.dtype.itemsize
            ):
                src = inp.args[0]
            part = val.shape[0] // size
            splits = [part] * size
            with graph.inserting_before(rs):
                a2a = _call_function(graph, c10d.all_to_all_single.default, src, splits, splits, name)
            a2a.meta.update({k: v for k, v in rs.meta.items() if k != "val"})
            wait.replace_input_with(rs, a2a)
            wait.meta["val"] = a2a.meta["val"]
            with graph.inserting_after(wait):
                view = _call_function(graph, aten.view.default, wait, [size, part, *val.shape[1:]])
            with graph.inserting_after(view):
                out = _call_function(graph, aten.sum.dim_IntList, view, [0], dtype=val.dtype)
            if op == "avg":
                with graph.inserting_after(out):
                    out = _call_function(graph, aten.div.Scalar, out, size)
            wait.replace_all_uses_with(out, delete_user_cb=lambda user: user is not view)
            graph.erase_node(rs)
            done += 1
        if done > done_before:
            g.recompile()
    return done


def _call_function(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """A new node at the graph's insertion point, with its fake value in `meta["val"]`."""
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = torch._guards.detect_fake_mode(node.all_input_nodes[0].meta["val"])
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def fence_reduce_scatters_pass(gm: fx.GraphModule) -> int:
    """XLA backends: each top-level reduce-scatter's waited result through an optimization barrier
    (identity); returns how many.

    libtpu lowers a reduce-scatter as an all-reduce of the whole tensor and a slice of this rank's
    part, which it fuses back into one all-reduce-scatter when the slice is the result's only
    reader. In an unrolled step the gradient shard's readers are the gradient norm and the optimizer
    update at the step's end; libtpu 0.0.52 fused the slice into each of them instead, so every
    parameter's whole fp32 gradient stayed live from its backward to the update (issue 54: 56 of 56
    reduce-scatters of the 4-block Qwen 3.5 9B program, 0.81 GiB per block, the 32-block recipe's
    refusal; docs/results/qwen3_5_9b_v6e_4layers_buffers_2026-12-07_d02d143.txt). Behind the
    barrier the slice has one reader and the shard is materialized where the gradient is reduced.
    Scan bodies need none (the shard goes into the stacked gradient, which libtpu fuses)."""
    from trainer.graph.remat import OPTIMIZATION_BARRIER

    c10d = torch.ops._c10d_functional
    graph, done = gm.graph, 0
    for rs in list(graph.nodes):
        if rs.op != "call_function" or rs.target is not c10d.reduce_scatter_tensor.default:
            continue
        waits = [u for u in rs.users if u.target is c10d.wait_tensor.default]
        if len(waits) != 1 or not waits[0].users:
            continue
        wait = waits[0]
        readers = list(wait.users)
        with graph.inserting_after(wait):
            barrier = graph.call_function(OPTIMIZATION_BARRIER, ([wait],))
        barrier.meta = {**{k: v for k, v in wait.meta.items() if k != "val"}, "val": [wait.meta.get("val")]}
        with graph.inserting_after(barrier):
            item = graph.call_function(operator.getitem, (barrier, 0))
        item.meta = dict(wait.meta)
        for reader in readers:
            reader.replace_input_with(wait, item)
        done += 1
    if done:
        gm.recompile()
    return done


def run_passes(
    gm: fx.GraphModule,
    *,
    reverse_scans: str | bool | None = None,
    decompositions: dict | None = None,
    fence_remat: bool = False,
    gloo_all_to_all: bool = True,
    offload: str = "none",
) -> GraphStats:
    """The pass pipeline, in place on `gm`: remat, scan views, (reversed scans), (gloo
    reduce-scatters as all-to-alls: `gloo_all_to_all`), all-gather prefetch, dead-code
    elimination, stats. `reverse_scans`: None / False: backward scans keep torch's flips;
    "loop" (or True): `scan_reverse_pass` (Inductor), tracing with `decompositions` (the
    compiler's table); "tag": `tag_reverse_scans` (torch-tpu). `fence_remat`: put the
    recomputed ops behind optimization barriers (XLA backends, trainer/graph/remat.py), and the
    reduce-scatters' results (`fence_reduce_scatters_pass`). `offload`: one of AC_OFFLOADS
    (block_inputs: `offload_block_inputs_pass`)."""
    if reverse_scans not in (None, False, True, "loop", "tag"):
        raise ValueError(f"reverse_scans: {reverse_scans!r}; allowed: None, 'loop', 'tag'")
    if offload not in AC_OFFLOADS:
        raise ValueError(f"offload: {offload!r}; allowed: {', '.join(AC_OFFLOADS)}")
    recomputed = remat_pass(gm, fence=fence_remat)
    scan_transpose_view_pass(gm)
    if offload == "block_inputs":
        offload_block_inputs_pass(gm)
    if reverse_scans == "tag":
        tag_reverse_scans(gm)
    elif reverse_scans:
        scan_reverse_pass(gm, decompositions=decompositions)
    if gloo_all_to_all:
        gloo_reduce_scatter_pass(gm)
    if fence_remat:  # XLA backends: each gradient shard materialized where it is reduced
        fence_reduce_scatters_pass(gm)
    prefetched = prefetch_all_gathers_pass(gm)
    dce_pass(gm)
    gm.graph.lint()
    stats = graph_stats(gm, recomputed=recomputed)
    stats.prefetched_gathers = prefetched
    return stats


def graph_text(gm: fx.GraphModule, stats: GraphStats | None = None) -> str:
    """Readable dump: a stats header, then the graph and its scan bodies with shapes."""
    head = f"# titan-tpu graph step\n# {stats.summary()}\n\n" if stats is not None else ""
    return head + gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)


_SOURCE = re.compile(r"\s*(File: .*|No stacktrace found.*)$")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def normalized_graph_text(gm: fx.GraphModule) -> str:
    """`graph_text` without source locations and object addresses (stable across edits elsewhere)."""
    lines = []
    for line in gm.print_readable(
        print_output=False, include_stride=True, include_device=False, colored=False
    ).splitlines():
        if line.lstrip().startswith("#"):
            # Comments carry node annotations (recompute tags) and source locations: keep
            # the former, drop the latter (they move whenever an unrelated line moves).
            line = _SOURCE.sub("", line)
            if line.strip() in ("#", "# -", ""):
                continue
        line = _ADDRESS.sub("0x?", line.rstrip())
        if line.strip() == "" and lines and lines[-1] == "":
            continue
        lines.append(line)
    return "\n".join(lines).strip() + "\n"
