"""Context parallelism for linear attention (parallelisms/context_parallel_linear.py) on gloo ranks.

- ops on cp = 2 and 4: `causal_conv1d` (with and without documents), `segment_starts` and
  `gated_delta_rule` (GQA, resets, the final state) in the load-balanced layout equal the
  single-process reference of the whole sequence, outputs and gradients (q, k, v, g, beta, the
  conv input and weight); a control without the state passing (the reference op on each rank's
  chunks from a zero state, the conv without the halo) is far off, so the comparison can fail.
- Qwen 3.5 (a 4-block hybrid debug model: 3 Gated DeltaNet blocks, 1 gated full-attention block)
  whose ops serve cp = 2 (`apply_cp` and `apply_linear_cp`, what the job registers): loss and
  every parameter gradient equal one process, with and without packed documents; the control
  registers only the cp attention (no linear-attention ops) and misses by orders of magnitude.

Bounds (fp32, u = 2^-24). The cp results are the same sums in another order: the delta rule's
output from a carried state is `o^0 + (Phi^T q)^T S` (a dk-term dot product added to the zero-start
output) instead of the state entering inside the op's chunk scan, and the state is folded over
2 cp chunks by matmuls of dk terms. The states stay O(|v|) (l2-normalised q/k, beta in (0, 1),
decays <= 1: the op's own bound, tests/unit/test_qwen3_5.py), so each output is off by a few
hundred u of max|out| at most: 1e-5 x max|ref| (~170 u), the bound of the op against its
recurrent reference. Gradients: the same products transposed, the same bound. The conv differs
only by where its zeros come from (exact: the same taps, the same order). The model: as
tests/unit/test_context_parallel.py's (loss 1e-6 relative, gradients 1e-5 of their max), except
`A_log` and `dt_bias`, whose gradients are sums over every token and channel of terms that nearly
cancel (|grad| ~ 1e-4 from terms ~ 1e-2, as tests/unit/test_qwen3_5.py's EP test says): 1e-4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.common import gated_delta, ops
from parallelisms.context_parallel import apply_cp, cp_group, positions, shard_sequence
from parallelisms.context_parallel_linear import (
    apply_linear_cp,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_segment_starts,
)
from tests.support.parallel_harness import run_processes

REL = 1e-5
SEQ = 64


def _segments(b: int, s: int, seed: int) -> torch.Tensor:
    """Document ids [b, s] with a few boundaries per row, some on cp chunk starts (every 8 tokens
    at cp 4, 16 at cp 2) and some inside chunks."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, s, generator=g) < 0.08
    starts[:, 16] = True  # a chunk boundary at cp 2 and 4
    starts[0, 40] = True  # inside a cp 2 chunk, at a cp 4 boundary
    starts[:, 0] = False
    return starts.long().cumsum(1)


def _delta_inputs(seed: int = 0, b: int = 2, s: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, 2, 8, generator=g)
    k = torch.randn(b, s, 2, 8, generator=g)
    v = torch.randn(b, s, 4, 6, generator=g)
    # Decays ~0.97 per token: a chunk still carries much of the state it starts from.
    gate = -F.softplus(torch.randn(b, s, 4, generator=g)) * 0.05
    beta = torch.rand(b, s, 4, generator=g)
    return q, k, v, gate, beta


def _delta(q, k, v, g, beta, reset, fn):
    return fn(q, k, v, g, beta, chunk_size=8, qk_l2norm=True, reset=reset, output_final_state=True)


def _ops_on_rank(documents: bool, state_passing: bool):
    """This rank's shard of the ops' inputs through the cp ops (or, `state_passing` false, the
    references on the shard); outputs and the gradients of the shards, for the comparison."""
    cp = cp_group(dist.group.WORLD)
    shard = lambda x: shard_sequence(x, 1, cp.rank, cp.size)  # noqa: E731
    inputs = [shard(t).requires_grad_() for t in _delta_inputs()]
    seg = shard(_segments(2, SEQ, 1)) if documents else None
    conv_x = shard(torch.randn(2, SEQ, 6, generator=torch.Generator().manual_seed(2))).requires_grad_()
    weight = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    if state_passing:
        conv_fn = cp_causal_conv1d(cp, ops.torch_causal_conv1d)
        starts_fn = cp_segment_starts(cp)
        delta_fn = cp_gated_delta_rule(cp, gated_delta.chunk_gated_delta_rule)
    else:
        conv_fn, starts_fn, delta_fn = (
            ops.torch_causal_conv1d,
            ops.torch_segment_starts,
            gated_delta.chunk_gated_delta_rule,
        )
    reset = None if seg is None else starts_fn(seg)
    out, final = _delta(*inputs, reset, delta_fn)
    conv = conv_fn(conv_x, weight, seg)
    w = torch.Generator().manual_seed(4)
    loss = (out * shard(torch.randn(2, SEQ, 4, 6, generator=w))).sum() + (
        conv * shard(torch.randn(2, SEQ, 6, generator=w))
    ).sum()
    loss = loss + (final * torch.randn(final.shape, generator=w)).sum() / cp.size  # the final state: on every rank
    loss.backward()
    grads = [t.grad for t in inputs] + [conv_x.grad]
    dist.all_reduce(weight.grad)
    return dict(
        out=out.detach(), conv=conv.detach(), reset=reset, final=final.detach(), grads=grads, dweight=weight.grad
    )


def _reference(documents: bool):
    inputs = [t.requires_grad_() for t in _delta_inputs()]
    seg = _segments(2, SEQ, 1) if documents else None
    conv_x = torch.randn(2, SEQ, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    weight = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    reset = None if seg is None else ops.torch_segment_starts(seg)
    out, final = _delta(*inputs, reset, gated_delta.chunk_gated_delta_rule)
    conv = ops.torch_causal_conv1d(conv_x, weight, seg)
    w = torch.Generator().manual_seed(4)
    loss = (out * torch.randn(2, SEQ, 4, 6, generator=w)).sum() + (conv * torch.randn(2, SEQ, 6, generator=w)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=w)).sum()
    loss.backward()
    grads = [t.grad for t in inputs] + [conv_x.grad]
    return dict(
        out=out.detach(), conv=conv.detach(), reset=reset, final=final.detach(), grads=grads, dweight=weight.grad
    )


def _worst(results, ref, cp_size: int) -> dict[str, float]:
    """Largest difference relative to max|ref| of each output and gradient, the ranks' shards
    compared with the reference's rows they hold."""
    worst: dict[str, float] = {}

    def note(name, got, want):
        rel = ((got - want).abs().max() / want.abs().max()).item()
        worst[name] = max(worst.get(name, 0.0), rel)

    for rank, got in enumerate(results):
        shard = lambda x: shard_sequence(x, 1, rank, cp_size)  # noqa: E731
        note("out", got["out"], shard(ref["out"]))
        note("conv", got["conv"], shard(ref["conv"]))
        note("final", got["final"], ref["final"])
        for name, g, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dconv_x"), got["grads"], ref["grads"]):
            note(name, g, shard(want))
        note("dconv_w", got["dweight"], ref["dweight"])
        if ref["reset"] is not None:
            assert torch.equal(got["reset"], shard(ref["reset"])), rank
    return worst


def _ops_both_ways(documents: bool) -> tuple[dict, dict]:
    """`_ops_on_rank` with and without the state passing, in one start of the processes."""
    return _ops_on_rank(documents, True), _ops_on_rank(documents, False)


EXHAUSTIVE = [pytest.mark.slow, pytest.mark.exhaustive]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cp_size, documents",
    [pytest.param(2, False, marks=EXHAUSTIVE), (2, True), pytest.param(4, True, marks=EXHAUSTIVE)],
    ids=["cp2", "cp2-docs", "cp4-docs"],
)
def test_ops_match_the_whole_sequence(cp_size, documents):
    """Outputs, final state and every gradient within 1e-5 x max|ref| (module docstring); the
    resets equal the whole sequence's document starts exactly. The control, in the same
    processes: each rank's chunks from a zero state and without the preceding tokens (the
    references on the shard) miss the whole-sequence outputs by O(1) of their max, so the
    comparison can fail."""
    ref = _reference(documents)
    results = run_processes(cp_size, _ops_both_ways, documents)
    worst = _worst([r[0] for r in results], ref, cp_size)
    print(f"cp {cp_size} documents {documents}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert max(worst.values()) <= REL, worst
    control = _worst([r[1] for r in results], dict(ref, reset=None), cp_size)
    print(
        f"cp {cp_size} documents {documents}, no state passing: "
        + ", ".join(f"{k} {v:.1e}" for k, v in control.items())
    )
    assert control["out"] > 0.1 and control["conv"] > 0.1 and control["final"] > 0.1, control


# --- the model ----------------------------------------------------------------------------------------


def _qwen3_5_args():
    from models.qwen3_5 import FLAVORS

    return dataclasses.replace(
        FLAVORS["debugmodel"],
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        hidden_dim=96,
        max_seq_len=SEQ,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        delta_chunk_size=8,
    )


def _qwen3_5_state() -> dict[str, torch.Tensor]:
    from models.qwen3_5 import Qwen3_5Transformer

    torch.manual_seed(0)
    model = Qwen3_5Transformer(_qwen3_5_args())
    model.init_weights()
    # Non-trivial norm weights (zeros at init would hide a norm applied to the wrong rows).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _qwen3_5_both_ways(state, tokens, labels, seg):
    """`_qwen3_5_on_rank` with and without the linear-attention ops, in one start of the processes."""
    return _qwen3_5_on_rank(state, tokens, labels, seg, True), _qwen3_5_on_rank(state, tokens, labels, seg, False)


def _qwen3_5_on_rank(state, tokens, labels, seg, linear_ops: bool):
    """The model on this rank's load-balanced tokens, its ops served for cp (`apply_cp`,
    `apply_linear_cp`, as the job does; `linear_ops` false: only the cp attention, the control);
    loss = this rank's token sum over the global count, loss and gradients summed over the ranks
    (SimpleFSDP over cp)."""
    from models.qwen3_5 import Qwen3_5Transformer

    cp = cp_group(dist.group.WORLD)
    model = Qwen3_5Transformer(_qwen3_5_args())
    model.load_state_dict(state)
    shard = lambda x: shard_sequence(x, 1, cp.rank, cp.size)  # noqa: E731
    saved = {op: ops.register(op, None) for op in ops.OPS + ops.SEQUENCE_OPS}
    try:
        if linear_ops:
            apply_cp(cp, "cpu", replacing="sdpa")
            apply_linear_cp(cp)
        else:
            from parallelisms.context_parallel import cp_attention_fn

            ops.register("causal_attention", cp_attention_fn(cp))
        pos = positions(tokens.shape[1], cp.rank, cp.size)
        logits = model(shard(tokens), None if seg is None else shard(seg), pos)
        loss = F.cross_entropy(logits.flatten(0, 1), shard(labels).flatten(), reduction="sum") / labels.numel()
        loss.backward()
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    dist.all_reduce(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    return loss.detach(), grads


def _qwen3_5_compare(documents: bool) -> list[tuple[float, dict[str, float]]]:
    """(loss relative difference, gradient differences relative to their max) of the cp run with
    the linear-attention ops and of the control without them."""
    from models.qwen3_5 import Qwen3_5Transformer

    args = _qwen3_5_args()
    state = _qwen3_5_state()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seg = _segments(2, SEQ, 6) if documents else None
    model = Qwen3_5Transformer(args)
    model.load_state_dict(state)
    ref_loss = F.cross_entropy(model(inputs, seg).flatten(0, 1), labels.flatten())
    ref_loss.backward()
    out = []
    for loss, grads in run_processes(2, _qwen3_5_both_ways, state, inputs, labels, seg)[0]:
        loss_rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        grad_rel = {
            n: ((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in model.named_parameters()
        }
        out.append((loss_rel, grad_rel))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("documents", [pytest.param(False, marks=EXHAUSTIVE), True], ids=["plain", "documents"])
def test_qwen3_5_cp2_matches_single_process(documents):
    """Loss within 1e-6 relative, every gradient within 1e-5 of its max (A_log, dt_bias: 1e-4;
    module docstring). The control, in the same processes: the cp attention alone (the Gated
    DeltaNet blocks each rank's chunks from a zero state, its conv without the preceding tokens)
    moves the loss and the DeltaNet gradients far outside those bounds."""
    (loss_rel, grad_rel), (control_loss, control_grad) = _qwen3_5_compare(documents)
    worst = max(grad_rel, key=grad_rel.get)
    qkv = "layers.0.attention.in_proj_qkv.weight"
    print(
        f"qwen3_5 cp2 documents={documents}: loss {loss_rel:.1e} rel, worst grad {worst} {grad_rel[worst]:.1e}; "
        f"without the linear ops: loss {control_loss:.1e}, {qkv} {control_grad[qkv]:.1e}"
    )
    assert loss_rel <= 1e-6
    for name, rel in grad_rel.items():
        assert rel <= (1e-4 if name.endswith(("A_log", "dt_bias")) else 1e-5), (name, rel)
    assert control_loss > 1e-4 and control_grad[qkv] > 1e-2
