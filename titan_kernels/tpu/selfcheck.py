"""Start-up self-check of the TPU kernels: each runs once on tiny tensors against its torch reference.

A Pallas kernel that fails to compile, raises at run time or computes a wrong answer on this
host (a libtpu or jax mismatch, a Mosaic change, an untried generation) must not take the run
down at step 1 nor train on garbage. Before the model is built, `run(impls, device=...)` calls
each selected implementation once, forward and backward, on tiny inputs of the run's dtype on
the run's device, and the op's torch reference (models/common/ops.py) in float32 on the CPU on
the same (dtype-rounded) inputs. A kernel that raises, returns a non-finite value or disagrees
is dropped: the reference serves that op for the whole run, and one banner line names the
kernel and why.

At the run's widths (`KernelShapes`, from the model and the mesh; `titan_kernels.select(shapes=)`):
what a kernel compiles to depends on its widths (tiles, VMEM, the MXU's lane padding), so a
check at other widths proves little for the run. With `shapes`:
- splash runs at the q/k and v head widths the op receives (MLA: q/k 192, v 128 for
  DeepSeek-V3 / Kimi K2, unpadded; `KernelShapes.of`);
- gmm runs at the experts' two matmuls, dim -> expert hidden and expert hidden -> dim;
- the fused loss runs at the model's hidden size (small vocabulary and rows), and
  `compile_check(op)` compiles its forward and backward, without running them, at the run's
  rows per device, hidden size and whole vocabulary, so with the vocabulary block the run uses
  (titan_kernels/tpu/compile_check.py on TPU; too large to run at start-up: 2 GiB of weight and as
  much of gradient for Llama 3 70B); gmm is compiled at the run's rows the same way;
- with context parallelism (`shapes.cp > 1`), the delta rule also runs as the cp wrapper calls
  it (parallelisms/context_parallel_linear.py): values `[v | 0]` at dv + dk columns from the
  state `[0 | I]`, q in float32 (`_delta_rule_cp_cases`); a failure there makes the reference
  serve the op (inside the wrapper) for the whole run, as any failure does;
- with context parallelism (`shapes.cp > 1`), the CP splash kernel of this rank
  (register.build_cp) runs on one 128-token chunk per half against its gathered keys, compared
  with dense attention at the chunks' global positions (`cp_reference`); a failure makes
  context parallelism's local product the dense-mask SDPA (parallelisms/context_parallel.py).
A kernel whose compile-only check fails is dropped like one that raises.

Imports torch and models.common.ops only (no jax, no torch-tpu), so the decision logic is
tested on the CPU with injected implementations (tests/unit/test_kernel_selfcheck.py); on a TPU the
implementations are those of titan_kernels/tpu/register.py.

Tolerance: every output (the forward value and each input gradient) must satisfy
`max|kernel - reference| <= TOLERANCE * max|reference|` with TOLERANCE = 2^-5 (3.1 %), the
same for every dtype. Why that number: the inputs are the same on both sides (rounded to the
run's dtype first), so only the kernel's own roundings count. The MXU multiplies bf16 operands
(also for float32 inputs at JAX's default precision) and accumulates in float32 (over <= 256
terms at the default widths, <= 16384 at a run's: <= 16384 * 2^-24 = 1e-3 relative, 30x below;
the inputs are scaled so that logits and outputs keep unit variance at any width). What remains is bf16 rounding
(unit roundoff u = 2^-9) of intermediates and outputs: attention's scaled q, its probabilities
before the PV matmul and its output; the fused loss' `softmax - onehot` before both backward
matmuls; gmm's output. Each rounding moves a result by at most u of the magnitude it feeds
(softmax weights sum to 1, so the PV sum does not amplify), and a logit error of u*|s| moves a
probability by ~u*|s| relative, with |s| <~ 3 at these inputs (unit-variance q.k / sqrt(d)).
Adding the chains (forward ~5u, backward, which re-forms the probabilities and multiplies twice,
~2x that) stays below 16u = 2^-5. The measured errors of the real kernels on these inputs in
Pallas' interpreter in bf16 are in docs/tpu.md ("Start-up self-check"); the bugs this guards
against (a wrong mask, group or label, a transposed weight, a missing scale) move outputs by
O(1) of their magnitude, 30x the tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from models.common import distributed, ops

TOLERANCE = 2.0**-5
"""Largest accepted max|kernel - reference| / max|reference| per output (module docstring)."""

KERNEL_NAMES = {
    "causal_attention": "splash",
    "attention": "full-mask splash",
    "sink_attention": "sink splash",
    "grouped_mm": "gmm",
    "linear_cross_entropy": "fused CE",
    "gated_delta_rule": "delta rule",
    "cp_attention": "CP splash",
}
"""The kernel that serves each op on TPU, as the banner names it."""

REFERENCES = {
    "causal_attention": ops.sdpa_causal_attention,
    "attention": ops.sdpa_attention,
    "sink_attention": ops.sdpa_sink_attention,
    "grouped_mm": ops.torch_grouped_mm,
    "linear_cross_entropy": ops.chunked_linear_cross_entropy,
    "gated_delta_rule": ops.torch_gated_delta_rule,
}
"""The torch reference of each op (what every other device runs, and the TPU fallback)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One self-check call: `fn(*args)` with gradients taken for `args[i]`, i in `grad_args`."""

    name: str
    args: tuple
    grad_args: tuple[int, ...]
    views: tuple[tuple[int, Callable], ...] = ()
    """(i, fn): the op receives fn(leaf i), not the leaf (the MoE experts hold [G, N, K]
    weights and pass their transposed view); gradients are taken for the leaf."""
    call: Callable | None = None
    """`call(fn, *args)` -> the one tensor compared, in place of `fn(*args)` (an op with keyword
    arguments and several outputs: the delta rule's output, or its final state)."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome for one op: `ok`, else `reason` says why the reference serves it."""

    op: str
    ok: bool
    reason: str = ""
    worst: float = 0.0
    """Largest error / scale over the op's outputs (for the banner and the docs)."""
    checked: str = ""
    """What was checked, at which widths (for the start-up line and the docs)."""

    @property
    def kernel(self) -> str:
        return KERNEL_NAMES.get(self.op, self.op)


DELTA_KERNEL_CHUNK = 64
"""Tokens per chunk of the TPU delta-rule kernel (titan_kernels/tpu/delta_rule.py `CHUNK`; this
module imports no jax): the only `chunk_size` the kernel serves (register.py hands any other to the
torch reference)."""


def delta_chunk_verdict(shapes: KernelShapes | None) -> Verdict | None:
    """A failed verdict for the delta-rule kernel when the model's `delta_chunk_size` is not the
    kernel's chunk: every call of the run would go to the torch reference (register.py), so the
    start-up says so in the kernels' banner line instead of the kernel silently not running.
    None: no delta rule in the model, or the kernel's chunk."""
    if shapes is None or not shapes.delta_heads or shapes.delta_chunk == DELTA_KERNEL_CHUNK:
        return None
    return Verdict(
        op="gated_delta_rule",
        ok=False,
        reason=(
            f"model.delta_chunk_size = {shapes.delta_chunk}: the kernel runs chunks of {DELTA_KERNEL_CHUNK} "
            f"tokens only (set delta_chunk_size = {DELTA_KERNEL_CHUNK} for the kernel)"
        ),
        checked=shapes.describe("gated_delta_rule"),
    )


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """The widths at which a run calls the kernels (`titan_kernels.select(shapes=)`; module docstring)."""

    hidden: int = 128
    """Residual width: the fused loss' h and w rows; the experts' input and output width."""
    vocab: int = 1000
    """Rows of the output projection (the fused loss' vocabulary); 0: no LM head."""
    qk_head_dim: int = 64
    """Head width of q and k as the attention op receives them."""
    v_head_dim: int = 64
    """Head width of v as the attention op receives it."""
    expert_hidden: int = 256
    """Each expert's MLP width (gmm's other width); with `num_experts` 0 the check uses it anyway."""
    num_experts: int = 0
    """Routed experts (0: a dense model, gmm is not called by the run)."""
    top_k: int = 0
    """Experts per token (gmm's rows are tokens x top_k)."""
    cp: int = 1
    """Context-parallel degree; > 1 adds the CP splash check."""
    cp_rank: int = 0
    """This process' rank in its context-parallel group (the CP kernels are per rank)."""
    tokens: int = 0
    """Tokens per device per micro-batch (the loss' rows); 0: not known (compile checks use 8192)."""
    delta_k_dim: int = 128
    """The gated delta rule's key width (Qwen 3.5's `linear_key_head_dim`); its value width next."""
    delta_v_dim: int = 128
    delta_heads: int = 0
    """The delta rule's value heads (0: the model has no delta rule; its check uses 4 heads anyway)."""
    delta_chunk: int = DELTA_KERNEL_CHUNK
    """The model's `delta_chunk_size` (Qwen 3.5): the kernel serves only its own chunk
    (`DELTA_KERNEL_CHUNK`); another is the reference's for the run (`delta_chunk_verdict`)."""
    sliding_window: int = 0
    """The model's sliding window (the op `sink_attention`'s kernel is built for it); 0: none."""

    @classmethod
    def of(cls, args, *, cp: int = 1, cp_rank: int = 0, tokens: int = 0) -> KernelShapes:
        """The shapes of a run of a model with `args` (a family's args dataclass)."""
        shape = args.shape()
        qk = v = shape.head_dim
        if hasattr(args, "qk_head_dim") and hasattr(args, "v_head_dim"):
            # MLA (models/deepseek_v3/model.py) hands the op q/k and v at their own widths (the
            # mean width in `shape()` is a FLOP-count device): those are what splash runs at.
            qk, v = args.qk_head_dim, args.v_head_dim
        return cls(
            hidden=shape.dim,
            vocab=shape.vocab_size,
            qk_head_dim=qk,
            v_head_dim=v,
            expert_hidden=shape.moe_hidden or 256,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            cp=cp,
            cp_rank=cp_rank,
            tokens=tokens,
            sliding_window=int(getattr(args, "sliding_window", 0) or 0),
            delta_k_dim=getattr(args, "linear_key_head_dim", 0) or 128,
            delta_v_dim=getattr(args, "linear_value_head_dim", 0) or 128,
            delta_heads=getattr(args, "linear_num_value_heads", 0) if hasattr(args, "linear_key_head_dim") else 0,
            delta_chunk=int(getattr(args, "delta_chunk_size", DELTA_KERNEL_CHUNK)),
        )

    def describe(self, op: str) -> str:
        """The widths `op` is checked at, in words."""
        if op in ("causal_attention", "attention"):
            return f"q/k {self.qk_head_dim}, v {self.v_head_dim}"
        if op == "sink_attention":
            return f"head {self.qk_head_dim}, window {self.sliding_window or SINK_WINDOW} and full"
        if op == "grouped_mm":
            return f"{self.hidden} -> {self.expert_hidden} -> {self.hidden}"
        if op == "gated_delta_rule":
            wide = f" and {self.delta_v_dim + self.delta_k_dim} (cp {self.cp})" if self.cp > 1 else ""
            return f"k {self.delta_k_dim}, v {self.delta_v_dim}{wide}"
        if op == "linear_cross_entropy":
            return f"hidden {self.hidden}" + (f", vocab {self.vocab}" if self.vocab else "")
        if op == "cp_attention":
            return f"cp {self.cp} rank {self.cp_rank}, q/k {self.qk_head_dim}, v {self.v_head_dim}"
        return ""


CP_CHUNK = 128
"""Tokens per chunk in the CP splash check: splash's tile, the smallest chunk the kernel takes."""
SINK_WINDOW = 48
"""The sliding window of the sink splash check when the run has none (smaller than its 200 tokens)."""


def cases(
    op: str, *, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16, shapes: KernelShapes | None = None
) -> list[Case]:
    """Tiny inputs for `op` on the CPU, rounded to `dtype` (seeded: the same every run), at the
    widths of `shapes` (default: small ones, attention at `head_dim`).

    Sizes: small enough to compile and run in seconds, large enough to cover what differs from
    a plain matmul: GQA (2 q heads per kv head), a length that is not a multiple of the splash
    tile (padding; with the full mask, padded keys a real query must not see), two documents
    (segment ids); an empty expert and uneven groups; a vocabulary
    that is not a multiple of the loss' vocab block and ignored labels.
    """
    shapes = shapes or KernelShapes(qk_head_dim=head_dim, v_head_dim=head_dim)
    gen = torch.Generator().manual_seed(1234)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    if op == "causal_attention":
        b, hq, hkv, s = 1, 4, 2, 200
        dq, dv = shapes.qk_head_dim, shapes.v_head_dim
        q, k, v = normal(b, hq, s, dq), normal(b, hkv, s, dq), normal(b, hkv, s, dv)
        seg = torch.cat([torch.zeros(b, 120, dtype=torch.int64), torch.ones(b, s - 120, dtype=torch.int64)], 1)
        return [Case("causal", (q, k, v), (0, 1, 2)), Case("segments", (q, k, v, seg), (0, 1, 2))]
    if op == "attention":  # full mask; 200 tokens: the padded keys must stay unseen
        b, hq, hkv, s = 1, 4, 2, 200
        dq, dv = shapes.qk_head_dim, shapes.v_head_dim
        q, k, v = normal(b, hq, s, dq), normal(b, hkv, s, dq), normal(b, hkv, s, dv)
        return [Case("full", (q, k, v), (0, 1, 2))]
    if op == "sink_attention":  # the run's window and a full layer, through one traced window
        b, hq, hkv, s, d = 1, 4, 2, 200, shapes.qk_head_dim
        q, k, v, sinks = normal(b, hq, s, d), normal(b, hkv, s, d), normal(b, hkv, s, d), normal(hq)
        seg = torch.cat([torch.zeros(b, 120, dtype=torch.int64), torch.ones(b, s - 120, dtype=torch.int64)], 1)
        w = shapes.sliding_window or SINK_WINDOW
        sliding, full = torch.tensor(w), torch.tensor(0)
        return [
            Case("window", (q, k, v, sinks, sliding, None, w), (0, 1, 2, 3)),
            Case("full segments", (q, k, v, sinks, full, seg, w), (0, 1, 2, 3)),
        ]
    if op == "gated_delta_rule":  # 150 tokens: 3 chunks of 64, the last padded; GQA 2 -> 4 heads
        b, s, hk, hv, dk, dv = 1, 150, 2, 4, shapes.delta_k_dim, shapes.delta_v_dim
        q, k, v = normal(b, s, hk, dk), normal(b, s, hk, dk), normal(b, s, hv, dv)
        g = -torch.nn.functional.softplus(torch.randn(b, s, hv, generator=gen)).to(dtype)
        beta = torch.randn(b, s, hv, generator=gen).sigmoid().to(dtype)
        state = normal(b, hv, dk, dv, std=0.5)
        reset = torch.zeros(b, s, dtype=torch.bool)
        reset[:, [40, 64, 100]] = True  # documents: mid-chunk, on a chunk boundary
        args = (q, k, v, g, beta, state, reset)
        out = [
            Case("documents, output", args, (0, 1, 2, 3, 4, 5), call=_delta_rule_output),
            Case("documents, final state", args, (1, 2, 3, 4, 5), call=_delta_rule_state),  # q: no part in it
        ]
        if shapes.cp > 1:  # the CP width (parallelisms/context_parallel_linear.py): [v | 0] from [0 | I]
            out.extend(_delta_rule_cp_cases(q, k, v, g, beta, reset))
        return out
    if op == "grouped_mm":
        sizes = torch.tensor([40, 0, 36, 20])
        out = []
        for name, k, n in (("up", shapes.hidden, shapes.expert_hidden), ("down", shapes.expert_hidden, shapes.hidden)):
            x, w_nk = normal(int(sizes.sum()), k), normal(len(sizes), n, k, std=k**-0.5)
            out.append(Case(f"linear-layout {name} {k}x{n}", (x, w_nk, sizes), (0, 1), views=((1, _experts_view),)))
        return out
    if op == "linear_cross_entropy":
        n, d, vocab = 100, shapes.hidden, 1000
        h, w = normal(n, d), normal(vocab, d, std=d**-0.5)
        labels = torch.randint(0, vocab, (n,), generator=gen)
        labels[:7] = ops.IGNORE_INDEX
        return [Case("ignored-labels", (h, w, labels), (0, 1))]
    if op == "cp_attention":
        b, hq, hkv, cp = 1, 4, 2, shapes.cp
        seq, local = 2 * cp * CP_CHUNK, 2 * CP_CHUNK
        dq, dv = shapes.qk_head_dim, shapes.v_head_dim
        q, k_all, v_all = normal(b, hq, local, dq), normal(b, hkv, seq, dq), normal(b, hkv, seq, dv)
        seg_all = (torch.arange(seq) >= seq // 3).to(torch.int64)[None].expand(b, seq).contiguous()
        seg = seg_all[:, cp_positions(seq, shapes.cp_rank, cp)]
        return [
            Case("causal", (q, k_all, v_all), (0, 1, 2)),
            Case("segments", (q, k_all, v_all, seg, seg_all), (0, 1, 2)),
        ]
    raise AssertionError(f"no self-check case for op {op!r}")


def cp_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of the tokens rank `cp_rank` holds: chunks r and 2 cp - 1 - r of
    seq_len / (2 cp) (parallelisms/context_parallel.py's layout; splash.py `cp_positions`)."""
    chunk = seq_len // (2 * cp_size)
    return torch.cat([cp_rank * chunk + torch.arange(chunk), (2 * cp_size - 1 - cp_rank) * chunk + torch.arange(chunk)])


def cp_reference(cp_rank: int, cp_size: int) -> Callable:
    """The CP splash kernel's reference for rank `cp_rank`: `fn(q, k_all, v_all, segment_ids=None,
    segment_ids_all=None)`, SDPA of the rank's queries at their global positions against all keys
    (key <= query, same segment)."""

    def attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None):
        seq = k_all.shape[2]
        pos = cp_positions(seq, cp_rank, cp_size).to(q.device)
        mask = (torch.arange(seq, device=q.device)[None, :] <= pos[:, None])[None, None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, None, :, None] == segment_ids_all[:, None, None, :])
        n_rep = q.shape[1] // k_all.shape[1]
        k, v = ops.repeat_kv(k_all, n_rep), ops.repeat_kv(v_all, n_rep)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attention


def _delta_rule(fn: Callable, q, k, v, g, beta, state, reset):
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, qk_l2norm=True, reset=reset)


def _delta_rule_cp_cases(q, k, v, g, beta, reset) -> list[Case]:
    """The call context parallelism makes of the op (`cp_gated_delta_rule`): q in float32, values
    `[v | 0]` (dk zero columns: dv + dk wide, 256 at Qwen 3.5's widths, where the kernel's tiles and
    VMEM differ from dv's) from the initial state `[0 | I]`; the output `[o^0 | Phi^T q]` and the
    final state `[F | Pi]` are what the ranks fold. The identity's columns carry the chunk's
    transition `Pi` (entries up to 1), the same magnitudes as the states the other cases check."""
    b, _, hv, dv = v.shape
    dk = k.shape[-1]
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32)
    state = torch.cat([eye.new_zeros(dk, dv), eye], dim=-1).expand(b, hv, dk, dv + dk).contiguous()
    args = (q.float(), k, wide, g, beta, state, reset)
    return [
        Case("cp width, output", args, (0, 1, 2, 3, 4), call=_delta_rule_output),
        Case("cp width, final state", args, (1, 2, 3, 4), call=_delta_rule_state),
    ]


def _delta_rule_output(fn: Callable, *args) -> torch.Tensor:
    return _delta_rule(fn, *args)[0]


def _delta_rule_state(fn: Callable, *args) -> torch.Tensor:
    return _delta_rule(fn, *args)[1]


def _experts_view(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1)


def _call(fn: Callable, case: Case, device: torch.device, dtype: torch.dtype, *, upcast: bool) -> list[torch.Tensor]:
    """Forward and backward of `fn` on `case`: [output, grad of each grad arg], float32 on the CPU.

    upcast: float32 copies of the inputs (the reference side); else the inputs as given (in
    `dtype`). The cotangent of a tensor output is a fixed seeded tensor of the output's shape,
    rounded to `dtype` on both sides.
    """
    args = []
    for i, a in enumerate(case.args):
        if not isinstance(a, torch.Tensor):  # None, an int (sink_attention's window size)
            args.append(a)
            continue
        t = a.to(device=device, dtype=torch.float32 if upcast and a.is_floating_point() else a.dtype)
        if i in case.grad_args:
            t = t.detach().requires_grad_(True)
        args.append(t)
    leaves = [args[i] for i in case.grad_args]
    call_args = list(args)
    for i, view in case.views:
        call_args[i] = view(args[i])
    out = fn(*call_args) if case.call is None else case.call(fn, *call_args)
    if out.dim() == 0:
        cot = torch.ones_like(out)
    else:
        gen = torch.Generator().manual_seed(99)
        cot = torch.randn(out.shape, generator=gen).to(dtype).to(dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad(out, leaves, cot)
    return [t.detach().float().cpu() for t in (out, *grads)]


def compare(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> tuple[str | None, float]:
    """(None, worst error/scale) if every output agrees within TOLERANCE, else (why, worst)."""
    worst = 0.0
    for name, g, w in zip(names, got, want):
        if g.shape != w.shape:
            return f"{name} has shape {tuple(g.shape)}, the reference {tuple(w.shape)}", float("inf")
        if not torch.isfinite(g).all():
            return f"{name} is not finite", float("inf")
        scale = w.abs().max().item()
        err = (g - w).abs().max().item()
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        worst = max(worst, rel)
        if rel > TOLERANCE:
            return (
                f"{name} differs from the reference by {err:.3g} (scale {scale:.3g}: {rel:.2%} > {TOLERANCE:.2%})"
            ), worst
    return None, worst


CompileCheck = Callable[[str], "tuple[bool, str] | None"]
"""`compile_check(op)`: None (nothing to compile for `op`), (True, what compiled) or (False, why
not): the kernel of `op` compiled, not run, at the run's shapes (titan_kernels/tpu/compile_check.py)."""


def _first_line(exc: Exception) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:200]}"


def check(
    op: str,
    impl: Callable,
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 64,
    reference: Callable | None = None,
    shapes: KernelShapes | None = None,
    compile_check: CompileCheck | None = None,
) -> Verdict:
    """Run `impl` (the kernel's op implementation) and `reference` (default: the op's torch
    reference) on `cases(op)` at the widths of `shapes`, after `compile_check(op)` if given; the
    Verdict says whether `impl` may serve `op`."""
    shapes = shapes or KernelShapes(qk_head_dim=head_dim, v_head_dim=head_dim)
    if reference is None:
        reference = cp_reference(shapes.cp_rank, shapes.cp) if op == "cp_attention" else REFERENCES[op]
    checked = shapes.describe(op)
    if compile_check is not None:
        try:
            compiled = compile_check(op)
        except Exception as exc:  # the check itself broke: the kernel is not known to compile
            compiled = (False, f"the compile-only check raised {_first_line(exc)}")
        if compiled is not None:
            ok, note = compiled
            if not ok:
                return Verdict(op, False, note, checked=checked)
            checked += f"; {note}"
    worst = 0.0
    for case in cases(op, head_dim=head_dim, dtype=dtype, shapes=shapes):
        names = ["out"] + [f"grad[{i}]" for i in case.grad_args]
        try:
            got = _call(impl, case, device, dtype, upcast=False)
        except Exception as exc:  # whatever the kernel raises, the reference serves
            return Verdict(op, False, f"{case.name} case raised {_first_line(exc)}", checked=checked)
        want = _call(reference, case, torch.device("cpu"), dtype, upcast=True)
        why, rel = compare(got, want, names)
        worst = max(worst, rel)
        if why:
            return Verdict(op, False, f"{case.name} case: {why}", worst, checked=checked)
    return Verdict(op, True, worst=worst, checked=checked)


def run(
    impls: dict[str, Callable],
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    references: dict[str, Callable] | None = None,
    shapes: KernelShapes | None = None,
    compile_check: CompileCheck | None = None,
) -> tuple[dict[str, Callable], list[Verdict]]:
    """Self-check every implementation in `impls` ({op: fn}; "cp_attention": this rank's CP
    splash, `fn(q, k_all, v_all, segment_ids=None, segment_ids_all=None)`) at the widths of
    `shapes`, each after `compile_check(op)`; return (the ones that passed on every rank, every
    Verdict). `references` overrides the torch references (tests)."""
    verdicts = [
        check(
            op,
            impl,
            device=device,
            dtype=dtype,
            head_dim=head_dim or 64,
            reference=(references or {}).get(op),
            shapes=shapes,
            compile_check=compile_check,
        )
        for op, impl in impls.items()
    ]
    verdicts = agree(verdicts, device=device)
    return {v.op: impls[v.op] for v in verdicts if v.ok}, verdicts


def agree(verdicts: list[Verdict], *, device: torch.device) -> list[Verdict]:
    """The verdicts every rank of the default process group shares: a kernel that failed on any
    rank is dropped on all (ranks that served an op differently would trace different programs
    and stop at their first mismatched collective). One all-reduce (MIN) of a pass vector on
    `device`; nothing without an initialised group of more than one rank."""
    import torch.distributed as dist

    if not verdicts or not distributed.multi_rank():
        return verdicts
    passed = torch.tensor([1.0 if v.ok else 0.0 for v in verdicts], device=device)
    dist.all_reduce(passed, op=dist.ReduceOp.MIN)
    everywhere = passed.cpu().tolist()
    return [
        v if (v.ok == bool(p)) else dataclasses.replace(v, ok=False, reason="failed on another rank (see its log)")
        for v, p in zip(verdicts, everywhere)
    ]


def banner(verdict: Verdict) -> str:
    """The one start-up line for a kernel that failed its self-check."""
    assert not verdict.ok, verdict
    return (
        f"titan-tpu: kernel self-check: {verdict.kernel} ({verdict.op}) failed, the torch reference "
        f"serves it: {verdict.reason}"
    )
