"""`BlockStack`: the repeated decoder blocks of a model, run in order.

It is an `nn.ModuleDict` keyed "0".."n-1", so parameter names (`layers.3.attention.wq.weight`)
match TorchTitan checkpoints and parallel plans. Blocks take a fixed tuple of tensors
`(h, *args)` and return the new `h`, or `(h, aux, load)` where `aux` is a 0-dim auxiliary loss
term of the layer (an MoE block's load-balancing loss) and `load` its expert load [E] (token
copies routed to each expert). The stack sums the aux terms over its layers and keeps the sum
for `pop_aux_loss()`, and stacks the loads `[n_layers, E]` for `pop_expert_load()`; both are
taken outside the blocks, so a block never leaves state on itself and never knows how the stack
runs it: a scan over stacked weights replaces the Python loop here without touching any block.

Layer scan (`enable_scan()`, used by the graph trainer): every block's parameter `name` is
moved into one stacked tensor `[n_layers, *shape]`, and each block's parameter becomes a view
of its row, so the module tree, `parameters()`, optimizer state and state-dict keys are
unchanged and a checkpoint saved with scan loads without it (and the reverse). Under
`torch.compile` the stack then runs as one `torch.ops.higher_order.scan` over the stacked
tensors (block "0" is the template, called with `torch.func.functional_call` on one row per
step), so a captured graph holds one copy of the block whatever `n_layers` is. A block's aux
term and load are per-layer outputs of the scan (stacked `[n_layers]` and `[n_layers, E]`; the
aux terms summed after it). Outside
compilation the plain loop runs on the same storage: eager scan is slow and gains nothing.

A hybrid stack whose blocks repeat with a period p (Qwen 3.5: three Gated DeltaNet blocks, then
one full-attention block) is scanned p blocks per step (`scan_period`): the template is the first
p blocks run in order (`PeriodGroup`), each of their parameters `j.name` is stacked
`[n_layers / p, *shape]` over the blocks j, j + p, j + 2p, ..., and the per-layer outputs come
out `[n_layers / p, k]` (aux) and `[n_layers / p, k, E]` (loads, k the group's MoE blocks),
flattened back to layer order. With p = 1 nothing changes.

A stack whose first blocks differ from a periodic rest (DeepSeek-V4: three hash-routed blocks,
then CSA and HCA blocks alternating) is scanned with an unrolled prefix (`scan_layout`: the
smallest k, then the smallest p, such that blocks k.. repeat with period p over at least two scan
steps): blocks 0..k-1 keep their own parameters and run as the plain loop before the scan of
blocks k.. (template `k`, or the `PeriodGroup` of blocks k..k+p-1; row r of `j.name` is block
k + r p + j's). Their aux terms are added to the scan's, their loads come first (layer order). With
k = 0 (every stack whose blocks repeat from block 0) nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

_ABSTRACT = contextvars.ContextVar("titan_abstract_model", default=False)


@contextlib.contextmanager
def abstract_model() -> Iterator[None]:
    """Let `enable_scan` stack meta parameters: a model that is never materialized (the recipe
    check captures a pod-size step on meta tensors; there is no storage to alias)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


class BlockStack(nn.ModuleDict):
    """Decoder blocks keyed "0".."n-1"; `forward(h, *args)` applies them in order."""

    def __init__(self, blocks: Iterable[nn.Module]):
        super().__init__({str(i): block for i, block in enumerate(blocks)})
        self._scan: _ScanState | None = None
        # The last forward's aux sum and loads, each popped once: a dict changed in place, not two
        # module attributes re-assigned (Dynamo lost such an attribute's second assignment in a
        # program that runs the stack twice with layer scan: a graph step's second micro-batch).
        self._last: dict[str, torch.Tensor | None] = {}

    def forward(self, h: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        h, self._last["aux"], self._last["load"] = self.terms(h, *args)
        return h

    def terms(
        self, h: torch.Tensor, *args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`forward` without keeping anything on the stack: (h, the aux terms' sum, the loads
        `[n_layers, E]`; None, None without MoE blocks), for callers that run the stack several
        times in one captured program (graph-mode PP's iterations, trainer/graph/pipeline.py),
        where a forward-then-pop per run would not trace as separate values. The scan when
        compiled with layer scan, else the loop."""
        if self._scan is not None and torch.compiler.is_compiling():
            return self._scan_forward(h, args)
        h, aux_total, loads = _run_blocks(self.values(), h, args)
        return h, aux_total, torch.stack(loads) if loads else None

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Sum over layers of the blocks' aux terms of the last forward (None if no block returns
        one, or if it was already popped); clears it."""
        return self._last.pop("aux", None)

    def split_aux_loss(self) -> None:
        """For blocks whose aux term is a vector `[aux, extra...]` (DeepSeek-V4 with its indexer loss:
        the MoE balance loss and the indexer's KL): keep element 0 of the last forward's sum as the
        aux loss (`pop_aux_loss`) and the rest for `pop_aux_extra`. Called by the model right after
        the forward, in the same dict (what `forget` clears)."""
        aux = self._last.get("aux")
        assert aux is not None and aux.dim() == 1, "split_aux_loss needs a vector aux term"
        self._last["aux"], self._last["extra"] = aux[0], aux[1:]

    def pop_aux_extra(self) -> torch.Tensor | None:
        """The `[extra...]` part of the last forward's aux sum that `split_aux_loss` set aside (None
        if none, or if it was already popped); clears it."""
        return self._last.pop("extra", None)

    def pop_expert_load(self) -> torch.Tensor | None:
        """The blocks' expert loads of the last forward, `[n_layers, E]` float32 (None if no block
        returns one, or if it was already popped); clears it."""
        return self._last.pop("load", None)

    def forget(self) -> None:
        """Drop the last forward's terms unpopped. The graph step calls it before each step, so the
        traced program always starts from an empty stack (Dynamo guards on what the dict holds)."""
        self._last.clear()

    # --- layer scan ------------------------------------------------------------------------

    def enable_scan(
        self, *, param_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    ) -> None:
        """Stack the blocks' parameters and buffers and run the stack as a scan when compiled.

        `param_fn`, if given, maps one layer's row `{name: tensor}` to what the template block
        is called with (e.g. a data-parallel all-gather of the row's shards); it runs inside the
        scan body. Parameters that are DTensors are stacked by their local shards. Call it on
        materialized parameters, after any parallelism has replaced them.
        """
        prefix, period = self.scan_layout()
        blocks = list(self.values())
        tail = blocks[prefix:]
        if period > 1:
            # row r of `j.name` is block prefix + r * period + j's (`scan_layout` checked they match)
            groups = [tail[r : r + period] for r in range(0, len(tail), period)]
            template = PeriodGroup(groups[0])

            def tensors_of(name: str, is_param: bool) -> list[torch.Tensor]:
                j, _, inner = name.partition(".")
                return [_stored(group[int(j)], inner, is_param) for group in groups]

            self._stack(template, tensors_of, param_fn, blocks[:prefix])
            return
        template = tail[0]
        param_names = [n for n, _ in template.named_parameters()]
        buffer_names = [n for n, _ in template.named_buffers()]
        # Reached with blocks that differ only without a scan layout: name the first that differs,
        # and say that no tail repeats either.
        why = "" if prefix else ", and no tail of the stack (blocks k..) repeats over two or more scan steps"
        for i, block in enumerate(tail, start=prefix):
            if type(block) is not type(template):
                raise ValueError(
                    f"layer scan: block {i} is a {type(block).__name__}, block {prefix} a "
                    f"{type(template).__name__}; scanned blocks must be identical{why}; "
                    "allowed: compile.scan_layers = false"
                )
            names = [n for n, _ in block.named_parameters()] + [n for n, _ in block.named_buffers()]
            if names != param_names + buffer_names:
                raise ValueError(
                    f"layer scan: block {i} has different parameters/buffers than block {prefix}{why}; "
                    "allowed: compile.scan_layers = false"
                )
        self._stack(
            template, lambda name, is_param: [_stored(b, name, is_param) for b in tail], param_fn, blocks[:prefix]
        )

    def scan_layout(self) -> tuple[int, int]:
        """(k, p): layer scan runs blocks 0..k-1 unrolled, then blocks k.. p per scan step
        (`periodic_layout` of the blocks' signatures: block i and block i + p of the same class,
        parameter and buffer names, local shapes and dtypes). (0, 1) for identical blocks, and for
        blocks without such a layout (a stack of one block; blocks that do not repeat, whose scan
        `enable_scan` refuses with the first block that differs)."""
        return periodic_layout([_signature(b) for b in self.values()]) or (0, 1)

    def scan_period(self) -> int:
        """The p of `scan_layout`: with no prefix, the smallest p (dividing the stack's length, <
        the length) with which the blocks repeat; 1 for identical blocks."""
        return self.scan_layout()[1]

    def scan_template(self) -> nn.Module:
        """The module the scan body calls: the first block this stack scans (block k of
        `scan_layout`; a pipeline stage's stack may not hold "0"), or with a period p > 1 the
        `PeriodGroup` of blocks k..k+p-1."""
        if self._scan is not None:  # fixed by enable_scan: never re-derived while a step is traced
            return self._scan.template
        blocks = list(self.values())
        prefix, period = self.scan_layout()
        return blocks[prefix] if period == 1 else PeriodGroup(blocks[prefix : prefix + period])

    def scan_prefix(self) -> tuple[nn.Module, ...]:
        """The blocks layer scan runs unrolled before the scan (`scan_layout`'s k, in order; ()
        before `enable_scan`)."""
        return self._scan.prefix if self._scan is not None else ()

    def _stack(self, template: nn.Module, tensors_of: Callable, param_fn, prefix: list[nn.Module]) -> None:
        """For every parameter and buffer `name` of `template`, stack `tensors_of(name, is_param)`
        (one tensor per scan step, the local shard of a DTensor) into one tensor whose rows they
        then view; the scan state (`prefix`: the blocks run unrolled before the scan)."""
        param_names = [n for n, _ in template.named_parameters()]
        buffer_names = [n for n, _ in template.named_buffers()]
        stacked: dict[str, torch.Tensor] = {}
        members: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for name in param_names + buffer_names:
                is_param = name in param_names
                tensors = tensors_of(name, is_param)
                locals_ = [_local(t) for t in tensors]
                ref = locals_[0]
                for i, t in enumerate(locals_):
                    if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                        raise ValueError(
                            f"layer scan: {name} of block {i} is {tuple(t.shape)} {t.dtype} "
                            f"on {t.device}, block 0 has {tuple(ref.shape)} {ref.dtype}; "
                            "allowed: compile.scan_layers = false"
                        )
                    if t.device.type == "meta" and not _ABSTRACT.get():
                        raise ValueError(
                            "layer scan: the block is on the meta device; allowed: enable_scan() on a "
                            "materialized model (or under abstract_model())"
                        )
                stack = torch.stack([t.detach() for t in locals_])
                for i, t in enumerate(locals_):
                    t.data = stack[i]  # the per-layer tensor becomes a view of row i
                if is_param and tensors[0].requires_grad:
                    stack.requires_grad_(True)
                stacked[name] = stack
                members[name] = tensors
        self._scan = _ScanState(
            param_names=param_names,
            buffer_names=buffer_names,
            stacked=stacked,
            members=members,
            param_fn=param_fn,
            template=template,
            prefix=tuple(prefix),
        )

    def stacked_parameters(self) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
        """`{name: (stacked [n_layers, ...], [per-layer parameter of each block])}`."""
        assert self._scan is not None, "layer scan is not enabled"
        return {n: (self._scan.stacked[n], self._scan.members[n]) for n in self._scan.param_names}

    def resync_scan_storage(self) -> int:
        """Re-point per-layer tensors that no longer view their stacked row; return how many.

        Something that swaps a parameter's storage (`load_state_dict(assign=True)`, `.to()`,
        `p.data = ...`) breaks the aliasing: the values are copied back into the stacked row
        and the tensor views it again, so the scanned step sees what the model holds.
        """
        assert self._scan is not None, "layer scan is not enabled"
        return sum(view_rows(stack, self._scan.members[name]) for name, stack in self._scan.stacked.items())

    def _scan_forward(
        self, h: torch.Tensor, args: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        from torch._higher_order_ops.scan import scan

        state = self._scan
        template = state.template  # a pipeline stage's stack may not hold "0"
        # the unrolled prefix (scan_layout's k blocks), as `terms`' loop
        h, aux, loads = _run_blocks(state.prefix, h, args)

        def body(carry: torch.Tensor, row: dict[str, torch.Tensor]):
            params = {n: row[n] for n in state.param_names}
            if state.param_fn is not None:
                params = state.param_fn(params)
            tensors = {**params, **{n: row[n] for n in state.buffer_names}}
            out = torch.func.functional_call(template, tensors, (carry, *args))
            if isinstance(out, tuple):  # (h, aux, load): per-layer outputs
                return out[0], [out[1], out[2]]
            # `[]`: no per-layer outputs (scan rejects None here).
            return out, []

        h, ys = scan(body, h, state.stacked)
        # ys[0] is [n_layers] ([n_layers / p, k] with a period): the layers' aux terms, summed over
        # the layers here as the loop sums them (a vector aux term [m] keeps its last dim); ys[1]
        # the loads [n_layers, E] ([n_layers / p, k, E] with a period: flattened to layer order).
        if ys:
            scan_aux = ys[0].sum(dim=(0, 1) if isinstance(template, PeriodGroup) else 0)
            aux = scan_aux if aux is None else aux + scan_aux
            loads.append(ys[1].flatten(0, 1) if ys[1].dim() == 3 else ys[1])
        if not loads:
            return h, aux, None
        # the prefix's loads [E] each, then the scan's rows: layer order
        rows = [load.unsqueeze(0) if load.dim() == 1 else load for load in loads]
        return h, aux, torch.cat(rows).detach()


@dataclass
class _ScanState:
    param_names: list[str]
    buffer_names: list[str]
    stacked: dict[str, torch.Tensor]
    """name -> [n_layers, *local shape]; the storage every block's tensor views."""
    members: dict[str, list[torch.Tensor]]
    """name -> each block's parameter/buffer object (DTensor or plain), in layer order."""
    param_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None
    template: nn.Module
    """What the body calls: the first scanned block, or a periodic scan's `PeriodGroup`."""
    prefix: tuple[nn.Module, ...] = ()
    """The blocks run unrolled before the scan (`scan_layout`'s k), in order."""


class PeriodGroup(nn.Module):
    """One period of a hybrid stack's blocks, run in order as one scan step: children "0".."p-1"
    are the stack's own first p blocks (the same modules, so the scan body's class swaps and
    hooks act on them). Not registered in the stack: the module tree is unchanged. Returns `h`,
    or `(h, aux [k], load [k, E])` over its k blocks that return an aux term and a load."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        for j, block in enumerate(blocks):
            self.add_module(str(j), block)

    def forward(self, h: torch.Tensor, *args: torch.Tensor):
        auxes, loads = [], []
        for block in self.children():
            out = block(h, *args)
            if isinstance(out, tuple):
                h, aux, load = out
                auxes.append(aux)
                loads.append(load)
            else:
                h = out
        return (h, torch.stack(auxes), torch.stack(loads)) if auxes else h


def periodic_layout(signatures: Sequence[Hashable]) -> tuple[int, int] | None:
    """(k, p) for a stack of blocks with these signatures: the smallest k, then the smallest p,
    such that blocks k.. repeat with period p (block i's signature is block k + (i - k) % p's) over
    at least two scan steps ((n - k) % p == 0, n - k >= 2p); None when no k has one."""
    n = len(signatures)
    for k in range(n - 1):
        rest = n - k
        for p in range(1, rest // 2 + 1):
            if rest % p == 0 and all(signatures[i] == signatures[k + (i - k) % p] for i in range(k, n)):
                return k, p
    return None


def _run_blocks(
    blocks: Iterable[nn.Module], h: torch.Tensor, args: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """The plain loop: (h after `blocks` in order, the sum of their aux terms or None, their loads)."""
    aux_total, loads = None, []
    for block in blocks:
        out = block(h, *args)
        if isinstance(out, tuple):
            h, aux, load = out
            aux_total = aux if aux_total is None else aux_total + aux
            loads.append(load)
        else:
            h = out
    return h, aux_total, loads


def _signature(block: nn.Module) -> tuple:
    """What two blocks must share to be rows of one stacked scan: class, and each parameter's and
    buffer's name, local shape and dtype."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (type(block), tuple((n, tuple(_local(t).shape), _local(t).dtype) for n, t in tensors))


def _stored(block: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    """The registered tensor `name` of `block`, bypassing properties that compute on access."""
    mod_name, _, attr = name.rpartition(".")
    module = block.get_submodule(mod_name)
    return (module._parameters if is_param else module._buffers)[attr]


@torch.no_grad()
def view_rows(stack: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    """Make `tensors[i]` (or its local shard) view `stack[i]` again, copying its values into the
    row first where it no longer does; return how many were re-pointed."""
    fixed = 0
    base, row_bytes = stack.data_ptr(), stack.stride(0) * stack.element_size()
    for i, t in enumerate(tensors):
        local = _local(t)
        # Pointer arithmetic, not stack[i]: this runs every step, for every row.
        if local.data_ptr() != base + i * row_bytes or local.shape != stack.shape[1:]:
            row = stack[i]
            row.copy_(local)
            local.data = row
            fixed += 1
    return fixed


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s data on this rank (a DTensor's local shard)."""
    # Duck-typed so models/ does not import torch.distributed.
    return t._local_tensor if hasattr(t, "_local_tensor") else t
