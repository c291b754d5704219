"""Context parallelism (parallelisms/context_parallel.py) against single-process references.

- layout: `shard_sequence` / `unshard_sequence` / `positions` are inverse and agree.
- tracing: `make_fx` of the CP attention's forward and backward (on a fake 2-rank process
  group) is one FX graph holding the functional all-gathers of k, v, segment ids and the
  reduce-scatters of dk, dv: what the graph trainer's capture and XLA see; and
  `torch.compile(fullgraph=True)` of it on 2 gloo ranks equals eager.
- attention on 2 and 4 gloo processes: fp32 outputs and dq, dk, dv equal the full-sequence
  causal attention (plain and document-masked, MHA and GQA) within the bound argued in
  `test_attention_matches_full_sequence`.
- Llama 3 and Qwen 3 (dense, q/k norm, GQA) debug models (2 layers) whose attention op and
  RoPE rows take the CP path on 2 gloo ranks: loss and every parameter gradient equal the
  single-process run; also through `parallelize_model` on meshes with a cp axis (SimpleFSDP
  over dp_shard x cp; cp = 2, dp 2 x cp 2, cp 2 x tp 2; per-block compile), and in the graph
  trainer's captured step, unrolled and with layer scan (3 AdamW steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.common import ops
from models.errors import ConfigError
from parallelisms import ParallelDims, build_mesh, parallelize_model
from parallelisms.context_parallel import (
    context_parallel_attention,
    cp_attention_fn,
    cp_group,
    positions,
    shard_sequence,
    unshard_sequence,
)
from tests.support.parallel_harness import FAMILIES, full, lm_loss, load_full_state, reference_state, run_processes

U = 2.0**-24  # fp32 unit roundoff


# --- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_shard_unshard_positions(cp_size):
    seq_len = 24 if cp_size != 4 else 16
    x = torch.arange(3 * seq_len).view(3, seq_len)
    shards = [shard_sequence(x, 1, r, cp_size) for r in range(cp_size)]
    assert all(s.shape == (3, seq_len // cp_size) for s in shards)
    assert torch.equal(unshard_sequence(torch.cat(shards, dim=1), 1, cp_size), x)
    covered = torch.cat([positions(seq_len, r, cp_size) for r in range(cp_size)])
    assert torch.equal(covered.sort().values, torch.arange(seq_len))
    for r in range(cp_size):
        assert torch.equal(positions(seq_len, r, cp_size), shard_sequence(x[0], 0, r, cp_size))
    if cp_size > 1:  # load balance: every rank holds the same sum of positions (causal work)
        sums = {int(positions(seq_len, r, cp_size).sum()) for r in range(cp_size)}
        assert len(sums) == 1


def test_bad_seq_len_names_the_key():
    with pytest.raises(ConfigError, match=r"parallelism\.context_parallel_degree: 4 .* divisible by 2 x 4 = 8"):
        shard_sequence(torch.zeros(2, 12), 1, 0, 4)


def test_config_key():
    """The key parses (2 is accepted: what CP does not cover is refused by the step plan's
    RULES, tests/e2e/test_cp_train.py); 0 is out of range."""
    from trainer.config import build_config

    assert build_config(None, []).parallelism.context_parallel_degree == 1
    assert build_config(None, [("parallelism.context_parallel_degree", "2")]).parallelism.context_parallel_degree == 2
    with pytest.raises(ConfigError, match=r"parallelism\.context_parallel_degree: 0 is out of range"):
        build_config(None, [("parallelism.context_parallel_degree", "0")])


# --- tracing ------------------------------------------------------------------------------------


def test_make_fx_graph_has_the_collectives():
    """The functional collectives trace: one graph with 3 all-gathers (k, v, segment ids) in
    the forward and 2 reduce-scatters (dk, dv) in the backward, on a fake 2-rank group."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cp = cp_group(dist.group.WORLD)

        def step(q, k, v, seg):
            out = context_parallel_attention(q, k, v, seg, cp=cp)
            return torch.autograd.grad(out.sum(), (q, k, v))

        q = torch.randn(1, 4, 8, 8, requires_grad=True)
        k = torch.randn(1, 2, 8, 8, requires_grad=True)
        v = torch.randn(1, 2, 8, 8, requires_grad=True)
        seg = torch.zeros(1, 8, dtype=torch.int64)
        gm = make_fx(step, tracing_mode="fake")(q, k, v, seg)
    finally:
        dist.destroy_process_group()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("_c10d_functional.all_gather_into_tensor.default") == 3, targets
    assert targets.count("_c10d_functional.reduce_scatter_tensor.default") == 2, targets
    assert targets.count("_c10d_functional.wait_tensor.default") >= 5


# --- attention on gloo ranks --------------------------------------------------------------------

B, SEQ, HEAD_DIM = 2, 64, 16
CASES = {  # name: (q heads, kv heads, with segment ids)
    "mha": (4, 4, False),
    "gqa_documents": (4, 2, True),
}


def _attention_inputs(q_heads: int, kv_heads: int, documents: bool):
    g = torch.Generator().manual_seed(q_heads * 10 + kv_heads + documents)
    q = torch.randn(B, q_heads, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=g)
    grad_out = torch.randn(B, q_heads, SEQ, HEAD_DIM, generator=g)
    # Documents of random lengths (a new one starts with probability 1/8 at each token).
    segment_ids = torch.cumsum(torch.rand(B, SEQ, generator=g) < 0.125, dim=1) if documents else None
    return q, k, v, grad_out, segment_ids


def _dense_local_attention(cp):
    """The kernel interface TPU splash serves (`local_attention(q, k_all, v_all, seg, seg_all)`:
    this rank's queries at their global positions against the gathered, unrepeated k/v), here
    as a dense masked SDPA, to test the gather / reduce-scatter plumbing around a kernel."""

    def local(q, k_all, v_all, seg, seg_all):
        n_rep = q.shape[1] // k_all.shape[1]
        q_pos = positions(k_all.shape[2], cp.rank, cp.size)
        mask = torch.arange(k_all.shape[2])[None, :] <= q_pos[:, None]
        if seg is not None:
            mask = (mask[None] & (seg[:, :, None] == seg_all[:, None, :]))[:, None]
        return F.scaled_dot_product_attention(
            q, ops.repeat_kv(k_all, n_rep), ops.repeat_kv(v_all, n_rep), attn_mask=mask
        )

    return local


def _attention_on_rank(with_kernel: bool = False):
    cp = cp_group(dist.group.WORLD)
    results = {}
    for name, case in CASES.items():
        q, k, v, grad_out, seg = _attention_inputs(*case)
        q, k, v = (shard_sequence(t, 2, cp.rank, cp.size).requires_grad_() for t in (q, k, v))
        seg = None if seg is None else shard_sequence(seg, 1, cp.rank, cp.size)
        out = context_parallel_attention(
            q, k, v, seg, cp=cp, local_attention=_dense_local_attention(cp) if with_kernel else None
        )
        out.backward(shard_sequence(grad_out, 2, cp.rank, cp.size))
        results[name] = [t.detach() for t in (out, q.grad, k.grad, v.grad)]
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cp_size, with_kernel", [(2, False), (4, False), (2, True)], ids=["cp2", "cp4", "cp2_kernel_interface"]
)
def test_attention_matches_full_sequence(cp_size, with_kernel):
    """fp32 out, dq, dk, dv equal the single-process `sdpa_causal_attention` of the whole
    sequence (gathered in global order) within `8 (s + d) u max|reference|`, u = 2^-24.

    Why that bound: both sides compute the same q.k products and the same visible set (a
    masked key contributes exp(-inf) = 0 exactly), so they differ only in the order and
    blocking of sums: dot products of length d, softmax denominators and P.V / P^T.dO /
    dS.K sums over at most s terms, and (dk, dv) a sum over cp ranks of the reduce-scatter.
    A length-n sum in any order is off by at most (n - 1) u times the sum of its absolute
    terms; the terms are convex-combination weights times values of the size of the result
    (p_ij in [0, 1], sum_j p_ij = 1), so each of the two implementations is within
    ~(s + d) u max|result| of the exact value per accumulation stage, and with the softmax,
    its normalisation and the backward's rowsum(dO * O) term there are at most about four
    such stages: 8 (s + d) u max|ref| (3.8e-5 relative at s = 64, d = 16) covers both. A
    wrong mask, chunk order or position is an O(1) relative error (dropping the late
    chunks' reversal gives 1.8). Measured (cp = 2 and 4): out and dq bit-identical, dk and
    dv <= 3.1e-7 relative (the cp-rank sum of the reduce-scatter).

    `with_kernel`: the `local_attention` path the TPU splash kernel takes (gathered k/v handed to
    a kernel whose k/v gradients the gather's reduce-scatter returns), with a dense stand-in
    for the kernel (the kernel itself: tests/xla/test_splash_cp.py); same bound.
    """
    results = run_processes(cp_size, _attention_on_rank, with_kernel)
    for name, case in CASES.items():
        q, k, v, grad_out, seg = _attention_inputs(*case)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref_out = ops.sdpa_causal_attention(q, k, v, seg)
        ref_out.backward(grad_out)
        refs = (ref_out.detach(), q.grad, k.grad, v.grad)
        for what, ref, i in zip(("out", "dq", "dk", "dv"), refs, range(4)):
            got = unshard_sequence(torch.cat([r[name][i] for r in results], dim=2), 2, cp_size)
            bound = 8 * (SEQ + HEAD_DIM) * U * ref.abs().max().item()
            err = (got - ref).abs().max().item()
            assert err <= bound, f"{name} {what}: max abs error {err:.3g} > bound {bound:.3g}"


def _compiled_on_rank():
    """`torch.compile(fullgraph=True)` of the CP attention (documents, GQA): no graph break,
    the collectives in the AOT forward/backward graphs, the same numbers as eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    cp = cp_group(dist.group.WORLD)
    q, k, v, grad_out, seg = _attention_inputs(*CASES["gqa_documents"])
    q, k, v, grad_out = (shard_sequence(t, 2, cp.rank, cp.size) for t in (q, k, v, grad_out))
    seg = shard_sequence(seg, 1, cp.rank, cp.size)
    runs = []
    for fn in (
        context_parallel_attention,
        torch.compile(
            context_parallel_attention, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)
        ),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, seg, cp=cp)
        out.backward(grad_out)
        runs.append([out.detach()] + [t.grad for t in leaves])
    return runs, graphs


@pytest.mark.multiprocess
def test_torch_compile_fullgraph():
    """Compiled (Dynamo + AOTAutograd, fullgraph) equals eager within 8 (s + d) u max|eager|
    (the argument of `test_attention_matches_full_sequence`: AOT may only reorder sums), and
    its forward graph all-gathers k, v and the segment ids, its backward reduce-scatters dk
    and dv."""
    for runs, graphs in run_processes(2, _compiled_on_rank):
        for eager, compiled in zip(*runs):
            bound = 8 * (SEQ + HEAD_DIM) * U * eager.abs().max().item()
            assert (compiled - eager).abs().max().item() <= bound
        forward, backward = graphs
        assert forward.count("_c10d_functional.all_gather_into_tensor.default") == 3, forward
        assert backward.count("_c10d_functional.reduce_scatter_tensor.default") == 2, backward


# --- a whole model --------------------------------------------------------------------------------


def _model_on_rank(family, state, tokens, labels):
    """Model forward/backward on this rank's load-balanced tokens, attention and RoPE on
    the CP path; the loss is this rank's token sum over the global count, and the loss and
    gradients are summed over the cp ranks (what SimpleFSDP over dp x cp would do)."""
    cp = cp_group(dist.group.WORLD)
    cls, make_args, _ = FAMILIES[family]
    model = cls(make_args())
    model.load_state_dict(state, strict=False)
    seq_len = tokens.shape[1]
    pos = positions(seq_len, cp.rank, cp.size)
    tokens_local = shard_sequence(tokens, 1, cp.rank, cp.size)
    labels_local = shard_sequence(labels, 1, cp.rank, cp.size)
    previous = ops.register("causal_attention", cp_attention_fn(cp))
    try:
        h = model.tok_embeddings(tokens_local)
        h = model.layers(h, model.rope_cos[pos], model.rope_sin[pos])
        logits = model.output(model.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels_local.flatten(), reduction="sum")
        loss = loss / labels.numel()
        loss.backward()
    finally:
        ops.register("causal_attention", previous)
    dist.all_reduce(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    return loss.detach(), grads


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_model_cp2_matches_single_process(family):
    """Loss within 1e-6 relative and every gradient within 1e-5 of its tensor's max |value|.

    The two runs differ only in summation order: attention sums (bounded as in
    `test_attention_matches_full_sequence`, ~1e-5 relative at s = 16), the loss split into
    two partial sums, and each weight gradient summed over the two ranks' tokens instead of
    in one matmul over all of them. The loss is a mean of 64 O(8) terms, each off by a few
    u, so 1e-6 relative is 15 u with room; the gradients are the attention bound carried
    through two layers of O(1)-conditioned linear maps (RMSNorm, SwiGLU, projections).
    Measured (Llama 3): loss bit-identical, gradients <= 7.2e-7 relative to their max.
    """
    cls, make_args, _ = FAMILIES[family]
    args = make_args()
    state = reference_state(family)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    model = cls(args)
    model.load_state_dict(state, strict=False)
    ref_loss = lm_loss(model(inputs), labels)
    ref_loss.backward()

    for loss, grads in run_processes(2, _model_on_rank, family, state, inputs, labels):
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
        for name, param in model.named_parameters():
            ref = param.grad
            err = (grads[name] - ref).abs().max().item()
            assert err <= 1e-5 * ref.abs().max().item(), f"{name}: {err:.3g}"


def _parallel_model_on_rank(family, degrees, state, tokens, labels, compile_backend=None):
    """`parallelize_model` on a mesh with a cp axis (SimpleFSDP over dp_shard x cp, TP when
    asked), then one forward/backward with attention and RoPE on the CP path. Each rank's
    loss is the mean over its own tokens (equal counts), and SimpleFSDP's gradient mean over
    the dp_shard x cp ranks makes that the global mean, as in TorchTitan."""
    world_size = dist.get_world_size()
    dims = ParallelDims(world_size=world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    cls, make_args, plan = FAMILIES[family]
    with torch.device("meta"):
        model = cls(make_args())
    parallelize_model(
        model,
        plan=plan,
        parallel_dims=dims,
        mesh=mesh,
        compile_backend=compile_backend,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # RoPE buffers; the weights come from `state`
    load_full_state(model, state)
    cp = cp_group(mesh["cp"])
    dp_rank = dims.dp_rank(mesh)
    pos = positions(tokens.shape[1], cp.rank, cp.size)
    tokens_local, labels_local = (
        shard_sequence(t.chunk(dims.dp_degree)[dp_rank], 1, cp.rank, cp.size) for t in (tokens, labels)
    )
    previous = ops.register("causal_attention", cp_attention_fn(cp))
    try:
        h = model.tok_embeddings(tokens_local)
        h = model.layers(h, model.rope_cos[pos], model.rope_sin[pos])
        loss = lm_loss(model.output(model.norm(h)), labels_local)
        loss.backward()
    finally:
        ops.register("causal_attention", previous)
    loss = full(loss.detach()).clone()
    dist.all_reduce(loss)  # TP ranks hold equal copies: the mean over all ranks is the global mean
    loss /= world_size
    mesh_axes = dict(model.named_parameters())["output.weight"].device_mesh.mesh_dim_names
    return loss, {n: full(p.grad) for n, p in model.named_parameters()}, mesh_axes


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "family, world_size, degrees, compile_backend",
    [
        ("llama3", 2, dict(dp_shard=1, cp=2), None),
        ("llama3", 4, dict(dp_shard=2, cp=2), None),
        ("qwen3", 4, dict(dp_shard=1, cp=2, tp=2), None),
        pytest.param("llama3", 2, dict(dp_shard=1, cp=2), "aot_eager", marks=pytest.mark.slow),  # ~30 s
    ],
    ids=["llama3-cp2", "llama3-dp2xcp2", "qwen3-cp2xtp2", "llama3-cp2-block-compile"],
)
def test_parallelized_model_with_cp_axis(family, world_size, degrees, compile_backend):
    """SimpleFSDP over dp x cp (and TP; and per-block compile, the CP attention traced inside
    each compiled block) with CP attention: loss and gradients equal the
    single-process run within the bounds of `test_model_cp2_matches_single_process` (the
    gradient mean over ranks adds one more reordered sum of a few terms)."""
    cls, make_args, _ = FAMILIES[family]
    args = make_args()
    state = reference_state(family)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model = cls(args)
    model.load_state_dict(state, strict=False)
    ref_loss = lm_loss(model(inputs), labels)
    ref_loss.backward()
    for loss, grads, mesh_axes in run_processes(
        world_size, _parallel_model_on_rank, family, degrees, state, inputs, labels, compile_backend
    ):
        assert "dp_shard_cp" in mesh_axes, mesh_axes  # parameters are sharded over dp x cp
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
        for name, param in model.named_parameters():
            err = (grads[name] - param.grad).abs().max().item()
            assert err <= 1e-5 * param.grad.abs().max().item(), f"{name}: {err:.3g}"


def _graph_on_rank(state, scan):
    """The graph trainer's step (trainer/graph: forward, loss, backward, clipping and AdamW in
    one captured graph, aot_eager) over SimpleFSDP on dp_shard x cp, the CP forward as its
    `loss_fn`: 3 steps on this rank's load-balanced half of each sequence."""
    from tests.support.parallel_harness import LLAMA3_PLAN, batch
    from tests.unit.test_graph_fsdp import EPS, MAX_NORM, STEPS, _lr
    from trainer.graph import build_graph_step

    dims = ParallelDims(world_size=2, dp_shard=1, cp=2)
    mesh = build_mesh(dims, "cpu")
    cls, make_args, plan = FAMILIES["llama3"]
    with torch.device("meta"):
        model = cls(make_args())
    parallelize_model(
        model, plan=plan, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_full_state(model, state)
    cp = cp_group(mesh["cp"])
    pos = positions(make_args().max_seq_len, cp.rank, cp.size)

    def cp_loss(model, inputs, labels):
        h = model.layers(model.tok_embeddings(inputs), model.rope_cos[pos], model.rope_sin[pos])
        return lm_loss(model.output(model.norm(h)), labels)

    opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), eps=EPS, weight_decay=0.1, foreach=False)
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=MAX_NORM,
        backend="aot_eager",
        scan_layers=scan,
        plan=LLAMA3_PLAN,
        loss_fn=cp_loss,
    )
    previous = ops.register("causal_attention", cp_attention_fn(cp))
    losses = []
    try:
        for s in range(STEPS):
            inputs, labels = batch(4096, batch_size=4, seed=s)
            mb = [tuple(shard_sequence(t, 1, cp.rank, cp.size) for t in (inputs, labels))]
            mean = step(mb, _lr(s)).loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / 2)
    finally:
        ops.register("causal_attention", previous)
    return losses, {n: full(p).detach().clone() for n, p in model.named_parameters()}, dict(step.stats.collectives)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "scan",
    [
        False,
        # CP under graph mode + scan through the trainer: tests/e2e/test_cp_train.py.
        pytest.param(True, marks=pytest.mark.exhaustive),
    ],
    ids=["unrolled", "scan"],
)
def test_graph_step_with_cp(scan):
    """Graph mode (and layer scan) with CP attention and SimpleFSDP over cp = 2: 3 AdamW steps
    equal one eager process with the tolerances of tests/unit/test_graph_fsdp.py (losses 1e-5
    relative, weights 1e-5 absolute: 1 % of an AdamW step at lr 1e-3), and the captured graph
    holds the CP all-gathers next to SimpleFSDP's. ~30 s each on 2 busy cores."""
    from tests.unit.test_graph_fsdp import _reference

    state = reference_state(n_layers=2)
    ref_losses, ref_params = _reference(state)
    for losses, params, collectives in run_processes(2, _graph_on_rank, state, scan):
        for a, b in zip(ref_losses, losses):
            assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
        worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert worst <= 1e-5, worst
        # Unrolled, SimpleFSDP gathers each of 21 parameters at least once and CP adds k and v
        # per layer (with scan the layers' gathers are in the one body; the parity above, which
        # attention over the local shard alone misses by O(1), shows the CP path ran).
        if not scan:
            assert collectives["all_gather_into_tensor"] >= 21 + 2 * 2, collectives
