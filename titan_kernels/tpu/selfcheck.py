"""Start-up self-check of the TPU kernels: each runs once on tiny tensors against its torch reference.

A Pallas kernel that fails to compile, raises at run time or computes a wrong answer on this
host (a libtpu or jax mismatch, a Mosaic change, an untried generation) must not take the run
down at step 1 nor train on garbage. Before the model is built, `run(impls, device=...)` calls
each selected implementation once, forward and backward, on tiny inputs of the run's dtype on
the run's device, and the op's torch reference (models/common/ops.py) in float32 on the CPU on
the same (dtype-rounded) inputs. A kernel that raises, returns a non-finite value or disagrees
is dropped: the reference serves that op for the whole run, and one banner line names the
kernel and why.

Imports torch and models.common.ops only (no jax, no torch-tpu), so the decision logic is
tested on the CPU with injected implementations (tests/test_kernel_selfcheck.py); on a TPU the
implementations are those of titan_kernels/tpu/register.py.

Tolerance: every output (the forward value and each input gradient) must satisfy
`max|kernel - reference| <= TOLERANCE * max|reference|` with TOLERANCE = 2^-5 (3.1 %), the
same for every dtype. Why that number: the inputs are the same on both sides (rounded to the
run's dtype first), so only the kernel's own roundings count. The MXU multiplies bf16 operands
(also for float32 inputs at JAX's default precision) and accumulates in float32 (over <= 256
terms here: <= 256 * 2^-24 = 1.5e-5 relative, negligible). What remains is bf16 rounding
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

from models.common import ops

TOLERANCE = 2.0 ** -5
"""Largest accepted max|kernel - reference| / max|reference| per output (module docstring)."""

KERNEL_NAMES = {"causal_attention": "splash", "grouped_mm": "gmm", "linear_cross_entropy": "fused CE"}
"""The kernel that serves each op on TPU, as the banner names it."""

REFERENCES = {"causal_attention": ops.sdpa_causal_attention, "grouped_mm": ops.torch_grouped_mm,
              "linear_cross_entropy": ops.chunked_linear_cross_entropy}
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


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome for one op: `ok`, else `reason` says why the reference serves it."""

    op: str
    ok: bool
    reason: str = ""
    worst: float = 0.0
    """Largest error / scale over the op's outputs (for the banner and the docs)."""

    @property
    def kernel(self) -> str:
        return KERNEL_NAMES.get(self.op, self.op)


def cases(op: str, *, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[Case]:
    """Tiny inputs for `op` on the CPU, rounded to `dtype` (seeded: the same every run).

    Sizes: small enough to compile and run in seconds, large enough to cover what differs from
    a plain matmul: GQA (2 q heads per kv head), a length that is not a multiple of the splash
    tile (padding), two documents (segment ids); an empty expert and uneven groups; a vocabulary
    that is not a multiple of the loss' vocab block and ignored labels.
    """
    gen = torch.Generator().manual_seed(1234)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    if op == "causal_attention":
        b, hq, hkv, s = 1, 4, 2, 200
        q, k, v = normal(b, hq, s, head_dim), normal(b, hkv, s, head_dim), normal(b, hkv, s, head_dim)
        seg = torch.cat([torch.zeros(b, 120, dtype=torch.int64), torch.ones(b, s - 120, dtype=torch.int64)], 1)
        return [Case("causal", (q, k, v), (0, 1, 2)), Case("segments", (q, k, v, seg), (0, 1, 2))]
    if op == "grouped_mm":
        sizes = torch.tensor([40, 0, 36, 20])
        m, k, n = int(sizes.sum()), 128, 256
        x, w_nk = normal(m, k), normal(len(sizes), n, k, std=k ** -0.5)
        return [Case("linear-layout", (x, w_nk, sizes), (0, 1), views=((1, _experts_view),))]
    if op == "linear_cross_entropy":
        n, d, vocab = 100, 128, 1000
        h, w = normal(n, d), normal(vocab, d, std=d ** -0.5)
        labels = torch.randint(0, vocab, (n,), generator=gen)
        labels[:7] = ops.IGNORE_INDEX
        return [Case("ignored-labels", (h, w, labels), (0, 1))]
    raise AssertionError(f"no self-check case for op {op!r}")


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
        t = a.to(device=device, dtype=torch.float32 if upcast and a.is_floating_point() else a.dtype)
        if i in case.grad_args:
            t = t.detach().requires_grad_(True)
        args.append(t)
    leaves = [args[i] for i in case.grad_args]
    call_args = list(args)
    for i, view in case.views:
        call_args[i] = view(args[i])
    out = fn(*call_args)
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
            return (f"{name} differs from the reference by {err:.3g} (scale {scale:.3g}: "
                    f"{rel:.2%} > {TOLERANCE:.2%})"), worst
    return None, worst


def check(op: str, impl: Callable, *, device: torch.device, dtype: torch.dtype, head_dim: int = 64,
          reference: Callable | None = None) -> Verdict:
    """Run `impl` (the kernel's op implementation) and `reference` (default: the op's torch
    reference) on `cases(op)`; the Verdict says whether `impl` may serve `op`."""
    reference = reference or REFERENCES[op]
    worst = 0.0
    for case in cases(op, head_dim=head_dim, dtype=dtype):
        names = ["out"] + [f"grad[{i}]" for i in case.grad_args]
        try:
            got = _call(impl, case, device, dtype, upcast=False)
        except Exception as exc:  # whatever the kernel raises, the reference serves
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return Verdict(op, False, f"{case.name} case raised {type(exc).__name__}: {message[:200]}")
        want = _call(reference, case, torch.device("cpu"), dtype, upcast=True)
        why, rel = compare(got, want, names)
        worst = max(worst, rel)
        if why:
            return Verdict(op, False, f"{case.name} case: {why}", worst)
    return Verdict(op, True, worst=worst)


def run(impls: dict[str, Callable], *, device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
        references: dict[str, Callable] | None = None) -> tuple[dict[str, Callable], list[Verdict]]:
    """Self-check every implementation in `impls` ({op: fn}); return (the ones that passed on
    every rank, every Verdict). `references` overrides the torch references (tests)."""
    verdicts = [check(op, impl, device=device, dtype=dtype, head_dim=head_dim or 64,
                      reference=(references or {}).get(op)) for op, impl in impls.items()]
    verdicts = agree(verdicts, device=device)
    return {v.op: impls[v.op] for v in verdicts if v.ok}, verdicts


def agree(verdicts: list[Verdict], *, device: torch.device) -> list[Verdict]:
    """The verdicts every rank of the default process group shares: a kernel that failed on any
    rank is dropped on all (ranks that served an op differently would trace different programs
    and stop at their first mismatched collective). One all-reduce (MIN) of a pass vector on
    `device`; nothing without an initialised group of more than one rank."""
    import torch.distributed as dist

    if not verdicts or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return verdicts
    passed = torch.tensor([1.0 if v.ok else 0.0 for v in verdicts], device=device)
    dist.all_reduce(passed, op=dist.ReduceOp.MIN)
    everywhere = passed.cpu().tolist()
    return [v if (v.ok == bool(p)) else dataclasses.replace(v, ok=False, reason="failed on another rank (see its log)")
            for v, p in zip(verdicts, everywhere)]


def banner(verdict: Verdict) -> str:
    """The one start-up line for a kernel that failed its self-check."""
    assert not verdict.ok, verdict
    return (f"titan-tpu: kernel self-check: {verdict.kernel} ({verdict.op}) failed, the torch reference "
            f"serves it: {verdict.reason}")
