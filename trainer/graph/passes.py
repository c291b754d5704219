"""Passes over the captured ATen graph of the train step, run before it is compiled.

The pipeline (`run_passes`) is short and every pass does real work:
1. `remat` (trainer/graph/remat.py): recompute checkpoint-tagged forward ops in backward.
2. `scan_transpose_view`: in scan bodies, matmuls read transposed weight views instead of
   the transposed copies torch's functionalization of the body puts there.
3. `dce`: dead-code elimination (e.g. forward values nothing reads after remat, unused
   outputs of the optimizer's bookkeeping).
4. `stats` (`graph_stats`): counts nodes, ops, collectives, scans and the bytes the forward
   scans stack for the backward (the per-layer activation memory with layer scan). It does
   not change the graph; its numbers go to the dump, the metrics and the tests.

`graph_text` renders a graph for the dump (`[compile] dump_graph`) and `normalized_graph_text`
strips what changes without the graph changing (source locations, object addresses) for
the golden test.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import fx

from trainer.graph.remat import remat_pass

_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
                "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
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
    input_mutations: int = 0
    """In-place `copy_` writes back into inputs (parameters, optimizer state)."""

    def summary(self) -> str:
        coll = ", ".join(f"{k} {v}" for k, v in sorted(self.collectives.items())) or "none"
        return (f"nodes {self.nodes} (with subgraphs {self.nodes_total}), placeholders {self.placeholders}, "
                f"scans {self.scans} (saved {self.scan_saved_bytes / 2**20:.2f} MiB), matmuls {self.matmuls}, "
                f"recomputed {self.recomputed}, input mutations {self.input_mutations}, collectives: {coll}")


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
            if name == "scan":
                stats.scans += 1
                if top and not node.meta.get("autograd_backward", False):
                    # Outputs: the final carries, then the stacked per-step values; in a
                    # forward scan those are what its backward reads.
                    vals = node.meta.get("val") or ()
                    n_carry = len(node.args[1])
                    stats.scan_saved_bytes += sum(_bytes(v) for v in list(vals)[n_carry:])
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
            elif (node.target is torch.ops.aten.clone.default and isinstance(node.args[0], fx.Node)
                  and node.args[0].target in _TRANSPOSES):
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


def run_passes(gm: fx.GraphModule) -> GraphStats:
    """The pass pipeline, in place on `gm`: remat, scan views, dead-code elimination, stats."""
    recomputed = remat_pass(gm)
    scan_transpose_view_pass(gm)
    dce_pass(gm)
    gm.graph.lint()
    return graph_stats(gm, recomputed=recomputed)


def graph_text(gm: fx.GraphModule, stats: GraphStats | None = None) -> str:
    """Readable dump: a stats header, then the graph and its scan bodies with shapes."""
    head = f"# titan-tpu graph step\n# {stats.summary()}\n\n" if stats is not None else ""
    return head + gm.print_readable(print_output=False, include_stride=False, include_device=False,
                                    colored=False)


_SOURCE = re.compile(r"\s*(File: .*|No stacktrace found.*)$")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def normalized_graph_text(gm: fx.GraphModule) -> str:
    """`graph_text` without source locations and object addresses (stable across edits elsewhere)."""
    lines = []
    for line in gm.print_readable(print_output=False, include_stride=True, include_device=False,
                                  colored=False).splitlines():
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
