"""Expert parallelism against single-process references (CPU, ranks as threads).

- The dispatch / combine of one MoE layer, with random, empty and extremely unbalanced routing
  (every token to one expert, every token to another rank's experts, zero rows on a rank):
  outputs, input gradients, expert and router gradients and the aux loss equal the plain MoE.
- Qwen 3 MoE (2 layers of the debug flavor) through `parallelize_model` on EP, EP x FSDP,
  EP x TP and EP x FSDP x TP meshes: loss, aux loss and every parameter gradient equal those of
  one process on the whole global batch (the load-balancing loss is the global-batch one: expert
  frequencies summed over all ranks, see models/common/moe.py), with the default coefficient.
- Storage: expert weights are (efsdp, ep)-sharded DTensors of the full shape; keys unchanged.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from models.common.moe import GroupedExperts, MoE
from models.common.plan import ModelPlan
from models.qwen3 import FLAVORS, Transformer
from models.qwen3.plan import PLAN
from parallelisms import ParallelDims, apply_tp, build_mesh, data_parallel, parallelize_model
from parallelisms.expert_parallel import apply_ep, apply_global_load_balance, is_expert_parallel
from tests.support.parallel_harness import SEQ_LEN, batch, full, lm_loss, load_full_state, rel_diff, run_threads

TOL = 1e-5  # fp32; measured differences are ~1e-6 (summation order)


# --- one MoE layer --------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.moe = MoE(dim=dim, hidden_dim=hidden, num_experts=8, top_k=2, norm_topk_prob=True)


class _Layers(nn.Module):
    """The smallest model with a plan: one block holding a MoE layer."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(dim, hidden)})


_LAYER_PLAN = ModelPlan(block="layers", ep_block={"moe": "moe", "moe.router.gate": "router", "moe.experts": "experts"})
NUM_TOKENS = 10  # per rank
AUX_COEF = 0.1


def _routing_bias(routing: str, rank: int, dim: int) -> torch.Tensor:
    """Added to every token of `rank`; the router gate reads features 0..7 as expert logits."""
    bias = torch.zeros(dim)
    if routing == "one_expert":  # every token of every rank to experts 0 and 1 (ep rank 0)
        bias[0], bias[1] = 6.0, 5.0
    elif routing == "last_experts":  # every token to experts 6 and 7 (the last ep rank)
        bias[6], bias[7] = 6.0, 5.0
    elif routing == "per_rank":  # each rank sends everything to its own pair of experts
        bias[(3 * rank) % 8], bias[(3 * rank + 5) % 8] = 6.0, 5.0
    else:
        assert routing == "random"
    return bias


def _moe_case(routing: str, world_size: int, dim: int, hidden: int):
    torch.manual_seed(0)
    ref = _Layers(dim, hidden)
    with torch.no_grad():
        gate = torch.zeros(8, dim)
        gate[:, :8] = torch.eye(8)
        ref.layers["0"].moe.router.gate.weight.copy_(gate)
    xs = [torch.randn(1, NUM_TOKENS, dim) * 0.5 + _routing_bias(routing, r, dim) for r in range(world_size)]
    grads_out = [torch.randn(1, NUM_TOKENS, dim) for _ in range(world_size)]
    return ref, xs, grads_out


def _ep_layers(world_size: int, ep: int, dim: int, hidden: int, state: dict, recipe: str | None = None) -> nn.Module:
    """On a thread rank: `_Layers` with EP (and FSDP over the rest) in fp32, `state` loaded;
    `recipe`: the experts quantized under it first."""
    from parallelisms.quantize import apply_quantize

    dims = ParallelDims(dp_shard=world_size, ep=ep, world_size=world_size)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = _Layers(dim, hidden)
    if recipe is not None:
        apply_quantize(model, recipe=recipe, min_dim=0)
    fp32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)
    apply_ep(model, plan=_LAYER_PLAN, parallel_dims=dims, mesh=mesh, **fp32)
    data_parallel(model, mesh=mesh, **fp32)
    model.to_empty(device="cpu")
    load_full_state(model, state)
    return model


def _rank_loss(moe: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    out, aux_loss, _ = moe(x)
    return (out * grad_out).sum() + AUX_COEF * aux_loss


@pytest.mark.parametrize("routing", ["random", "one_expert", "last_experts", "per_rank"])
@pytest.mark.parametrize(
    "world_size, ep, dim, hidden",
    [
        (2, 2, 16, 32),  # grouped GEMM path
        (4, 4, 16, 32),  # one rank per pair of experts
        (4, 2, 8, 10),  # EP x FSDP (efsdp = 2), exact per-expert fallback loop
    ],
)
def test_dispatch_matches_single_process_moe(routing, world_size, ep, dim, hidden):
    ref, xs, grads_out = _moe_case(routing, world_size, dim, hidden)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    moe_ref = ref.layers["0"].moe
    want_out, want_dx, want_aux = [], [], []
    for x, g in zip(xs, grads_out):
        x = x.clone().requires_grad_()
        # The data-parallel gradient is the mean of the ranks' losses.
        (_rank_loss(moe_ref, x, g) / world_size).backward()
        out, aux, _ = moe_ref(x)
        want_out.append(out.detach())
        want_aux.append(aux.item())
        want_dx.append(x.grad * world_size)  # the rank itself differentiates its own loss
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    counts = [torch.bincount(torch.topk(x[0, :, :8], 2).indices.flatten(), minlength=8) for x in xs]

    def rank_fn():
        rank = dist.get_rank()
        model = _ep_layers(world_size, ep, dim, hidden, state)
        moe = model.layers["0"].moe
        x = xs[rank].clone().requires_grad_()
        _rank_loss(moe, x, grads_out[rank]).backward()
        out, aux, _ = moe(x)
        return (out.detach(), x.grad, aux.item(), {n: full(p.grad) for n, p in model.named_parameters()})

    results = run_threads(world_size, rank_fn)
    if routing != "random":  # the routing really is as extreme as intended
        assert all(int((c > 0).sum()) == 2 for c in counts)
    for rank, (out, dx, aux, grads) in enumerate(results):
        assert rel_diff(out, want_out[rank]) < TOL
        assert rel_diff(dx, want_dx[rank]) < TOL
        assert aux == pytest.approx(want_aux[rank], rel=1e-6)
        for name, want in want_grads.items():
            assert rel_diff(grads[name], want) < TOL, name
    # Experts nobody routed to get exactly zero gradient (and no NaN from empty batches).
    used = sum(counts)
    w1_grad = results[0][3]["layers.0.moe.experts.w1"]
    assert torch.all(w1_grad[used == 0] == 0) and torch.isfinite(w1_grad).all()


class _PoisonPadding(torch.autograd.Function):
    """Rows past `real` become NaN, and so do their gradients: what a grouped matmul that skips
    uncovered rows may leave there (torch._grouped_mm leaves them uninitialised)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        ctx.real = real
        pad = torch.arange(out.shape[0]) >= real
        return torch.where(pad.unsqueeze(-1), float("nan"), out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pad = torch.arange(grad.shape[0]) >= ctx.real
        return torch.where(pad.unsqueeze(-1), float("nan"), grad), None


@pytest.mark.parametrize("routing", ["random", "one_expert", "per_rank"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("transport", ["equal_split", "ragged", "ragged_own_backward"])
def test_static_dispatch_equals_ragged_dispatch(routing, world_size, transport):
    """`dispatch_combine_static` = `dispatch_combine`: same rows back and the same input and
    expert-weight gradients, to fp32 summation order (1e-6), with both transports (equal-split
    all-to-alls; torch-tpu's ragged all-to-all contract, emulated), and with the emulation run
    without autograd inside `titan_kernels.collectives.differentiable` (as torch-tpu's op, which has no
    autograd kernel: the gradients then come from its reverse all-to-all). The experts get counts
    that cover the real rows only (the same counts as the ragged dispatch gives them), and
    padding rows whose outputs and gradients are NaN leak into nothing."""
    import functools

    from models.common.moe import GroupedExperts
    from parallelisms.expert_parallel import dispatch_combine, dispatch_combine_static
    from titan_kernels.collectives import differentiable, emulate_ragged_all_to_all

    dim, num_experts = 16, 8
    torch.manual_seed(0)
    xs = [torch.randn(NUM_TOKENS, dim) * 0.5 + _routing_bias(routing, r, dim) for r in range(world_size)]
    experts_ref = GroupedExperts(dim=dim, hidden_dim=32, num_experts=num_experts // world_size)

    def rank_fn():
        from torch.distributed.device_mesh import init_device_mesh

        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world_size,))
        x = xs[rank]
        flat = torch.topk(x[:, :8], 2).indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        static = dispatch_combine_static
        if transport != "equal_split":
            op = functools.partial(emulate_ragged_all_to_all, max_rows=x.shape[0] * 2)
            if transport == "ragged_own_backward":
                op = differentiable(op)
            static = functools.partial(dispatch_combine_static, ragged_all_to_all=op)
        results = []
        for fn in (dispatch_combine, static):
            experts = GroupedExperts(dim=dim, hidden_dim=32, num_experts=num_experts // world_size)
            experts.load_state_dict(experts_ref.state_dict())
            seen = []

            def experts_fn(rows, group_sizes, experts=experts, seen=seen):
                seen.append((rows.shape[0], group_sizes.clone()))
                return _PoisonPadding.apply(experts(rows, group_sizes), group_sizes.sum())

            rows = x[order // 2].clone().requires_grad_()
            out = fn(rows, counts, experts_fn, mesh)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), rows.grad, experts.w1.grad.clone(), experts.w2.grad.clone(), seen[0]))
        return results

    for ragged, static in run_threads(world_size, rank_fn):
        (_, ragged_sizes), (static_rows, static_sizes) = ragged[-1], static[-1]
        assert torch.equal(static_sizes, ragged_sizes)  # same groups: only the real rows
        assert static_rows == world_size * NUM_TOKENS * 2  # the worst-case buffer
        for a, b in zip(ragged[:-1], static[:-1]):
            assert torch.isfinite(b).all()
            assert rel_diff(b, a) < 1e-6


def _capture_ep_moe_step(dispatch: str):
    """Trace forward + backward of a MoE layer with EP 2 (fake 2-rank world, symbolic shapes);
    `dispatch`: "select" (what `select_dispatch` picks under tracing) or "ragged" (forced).
    Returns (call targets, nodes whose value holds an unbacked symbol)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import parallelisms.expert_parallel as ep_module

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        moe = MoE(dim=16, hidden_dim=32, num_experts=8, top_k=2, norm_topk_prob=True)
        weights = [w.detach()[:4].clone() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)]
        group = (mesh.get_group().group_name, 2, 0)

        class _Experts(nn.Module):  # rank 0's 4 experts, weights set per call; EP forward
            recipe = "none"  # GroupedExperts' [quantize] recipe: not quantized
            act = GroupedExperts.act  # the experts' SwiGLU (DeepSeek-V4 overrides it)

            def forward(self, x, counts):
                fn = ep_module.select_dispatch(x) if dispatch == "select" else ep_module.dispatch_combine
                return fn(
                    x, counts, lambda r, c: GroupedExperts.forward(self, r, c), group if dispatch == "select" else mesh
                )

        experts = moe.experts = _Experts()

        def step(x, w1, w2, w3):
            experts.w1, experts.w2, experts.w3 = w1, w2, w3
            out, aux, _ = moe(x)
            return torch.autograd.grad(out.square().sum() + aux, (x, w1, w2, w3))

        inputs = [torch.randn(1, NUM_TOKENS, 16, requires_grad=True)]
        inputs += [w.requires_grad_() for w in weights]
        graph = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*inputs)
    finally:
        dist.destroy_process_group()
    nodes = [node for node in graph.graph.nodes if node.op == "call_function"]
    unbacked = [node for node in nodes if "val" in node.meta and free_unbacked_symbols(node.meta["val"])]
    return [str(node.target) for node in nodes], unbacked


def test_traced_ep_dispatch_has_no_data_dependent_ops():
    """The EP MoE layer's forward and backward as graph mode and a layer-scan body capture it
    (traced: `select_dispatch` takes the static dispatch) has no unbacked SymInt, no host read
    (`_local_scalar_dense`: `.item()`/`.tolist()`) and no data-dependent-shape op: one program
    for every routing pattern. The ragged dispatch, captured the same way, has them (so the
    check can fail)."""
    data_dependent = ("_local_scalar_dense", "nonzero", "masked_select", "unique")
    targets, unbacked = _capture_ep_moe_step("select")
    assert any("all_to_all_single" in t for t in targets), "the dispatch was not captured"
    assert not unbacked, unbacked
    assert not [t for t in targets if any(op in t for op in data_dependent)]
    # Every repeat_interleave has a static output_size (none is left in the static dispatch).
    assert not [t for t in targets if "repeat_interleave" in t]
    try:
        targets, unbacked = _capture_ep_moe_step("ragged")
    except Exception as err:  # noqa: BLE001 - a data-dependent error is the expected failure
        assert "data" in str(err).lower() or "unbacked" in str(err).lower() or "symbol" in str(err).lower(), err
    else:
        assert unbacked and any("_local_scalar_dense" in t for t in targets)


def test_expert_shard_dim_goes_to_a_hidden_dim_beyond_the_experts():
    from parallelisms.expert_parallel import expert_shard_dim

    assert expert_shard_dim((4, 32, 16), 2) == 0  # 4 local experts over 2: whole experts
    assert expert_shard_dim((1, 32, 16), 4) == 1  # 1 local expert over 4: its hidden rows
    assert expert_shard_dim((1, 1536, 4096), 4) == 1  # 235B-A22B w1 on ep 128 x efsdp 4
    assert expert_shard_dim((3, 6, 5), 2) == 1
    assert expert_shard_dim((3, 5, 7), 2) == 0  # nothing divides: uneven expert shards


def test_expert_weights_are_sharded_over_efsdp_and_ep():
    def rank_fn():
        dims = ParallelDims(dp_shard=4, ep=2, world_size=4)
        with torch.device("meta"):
            model = _Layers(16, 32)
        mesh = build_mesh(dims, "cpu")
        apply_ep(model, plan=_LAYER_PLAN, parallel_dims=dims, mesh=mesh)
        data_parallel(model, mesh=mesh)
        experts = model.layers["0"].moe.experts
        w1 = experts._parameters["w1"]
        return (
            is_expert_parallel(experts),
            sorted(model.state_dict()),
            tuple(w1.shape),
            tuple(w1.to_local().shape),
            w1.placements,
            w1.device_mesh.mesh_dim_names,
        )

    with torch.device("meta"):
        keys = sorted(_Layers(16, 32).state_dict())
    for wrapped, names, shape, local_shape, placements, axes in run_threads(4, rank_fn):
        assert wrapped and names == keys
        assert shape == (8, 32, 16)
        # 8 experts / ep 2 = 4 per EP rank, split again over efsdp 2.
        assert local_shape == (2, 32, 16)
        assert axes == ("efsdp", "ep")
        assert placements == (_StridedShard(0, split_factor=2), Shard(0))


# --- the Qwen 3 MoE model -------------------------------------------------------------------

QWEN_AUX = 0.01
GLOBAL_BATCH = 4


def _qwen3_args(num_experts: int = 8):
    return dataclasses.replace(FLAVORS["debugmodel_moe"], n_layers=2, max_seq_len=SEQ_LEN, num_experts=num_experts)


def _reference(state, num_experts: int = 8):
    """Loss, aux loss and gradients of one process on the whole global batch.

    With the global-batch load-balancing loss every mesh trains on exactly this: the expert
    frequencies are counted over the global batch, and the data-parallel mean of the ranks'
    `E * sum f_i * P_i(rank)` is `E * sum f_i * P_i(global batch)`.
    """
    with torch.device("meta"):
        model = Transformer(_qwen3_args(num_experts))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.load_state_dict(state)
    inputs, labels = batch(model.args.vocab_size, GLOBAL_BATCH)
    lm = lm_loss(model(inputs), labels)
    aux = model.pop_aux_loss()
    (lm + QWEN_AUX * aux).backward()
    return lm.item(), aux.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "world_size, degrees",
    [
        (2, dict(dp_shard=2, ep=2)),
        (2, dict(dp_shard=1, tp=2, ep=2)),
        (4, dict(dp_shard=4, ep=2)),
        (4, dict(dp_shard=2, tp=2, ep=4)),
        (4, dict(dp_replicate=2, dp_shard=2, ep=2)),
        # ep = 1 with TP: experts whole on every rank, FSDP over dp_shard x tp (parallelize_model
        # only calls apply_ep for ep > 1, so this case assembles the steps itself).
        (2, dict(dp_shard=1, tp=2, ep=1)),
        # More ranks than experts: 2 experts, ep 2, efsdp 2 > 1 local expert, so the experts are
        # sharded along their hidden dim (expert_shard_dim) and every rank holds a quarter.
        (4, dict(dp_shard=4, ep=2, num_experts=2)),
    ],
)
def test_qwen3_moe_matches_single_process(world_size, degrees):
    degrees = dict(degrees)
    num_experts = degrees.pop("num_experts", 8)
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Transformer(_qwen3_args(num_experts))
    ref.to_empty(device="cpu")
    with torch.no_grad():
        ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    want_lm, want_aux, want_grads = _reference(state, num_experts)
    inputs, labels = batch(ref.args.vocab_size, GLOBAL_BATCH)

    def rank_fn():
        dims = ParallelDims(world_size=world_size, **degrees)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = Transformer(_qwen3_args(num_experts))
        if dims.ep_enabled:
            parallelize_model(
                model, plan=PLAN, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
            )
        else:
            apply_tp(model, plan=PLAN, tp_mesh=mesh["tp"])
            apply_ep(
                model, plan=PLAN, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
            )
            apply_global_load_balance(model, plan=PLAN, mesh=mesh)
            data_parallel(model, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        r, n = dims.dp_rank(mesh), GLOBAL_BATCH // dims.dp_degree
        lm = lm_loss(model(inputs[r * n : (r + 1) * n]), labels[r * n : (r + 1) * n])
        aux = model.pop_aux_loss()
        (lm + QWEN_AUX * aux).backward()
        experts = {n: (p.to_local().numel(), p.numel()) for n, p in model.named_parameters() if ".experts." in n}
        return r, lm.item(), aux.item(), {n: full(p.grad) for n, p in model.named_parameters()}, experts

    results = run_threads(world_size, rank_fn)
    # Every rank holds exactly 1/(efsdp x ep) of each expert weight (none holds nothing).
    expert_ranks = world_size // degrees.get("dp_replicate", 1)
    for *_, experts in results:
        assert experts and all(local * expert_ranks == total for local, total in experts.values()), experts
    results = [r[:4] for r in results]
    lm_mean = sum(lm for _, lm, _, _ in results) / world_size
    assert lm_mean == pytest.approx(want_lm, rel=1e-6)
    # Each rank's aux loss uses the global expert frequencies and its own tokens' router
    # probabilities (with TP: its sequence shard), so the mean over all ranks is the one-process
    # aux loss of the global batch.
    aux_mean = sum(aux for _, _, aux, _ in results) / world_size
    assert aux_mean == pytest.approx(want_aux, rel=1e-5)
    for _, _, _, grads in results:
        assert set(grads) == set(want_grads)
        for name, want in want_grads.items():
            assert rel_diff(grads[name], want) < TOL, name


def test_eager_step_adds_the_aux_loss_under_loss_parallel():
    """The trainer's eager step on Qwen 3 MoE at TP 2 with loss parallel: the LM loss is then a
    replicated DTensor and the aux loss a plain tensor (the rank's own tokens'); the backward of
    their sum failed in a mul mixing the two (found running DeepSeek-V4 at TP 2 with loss
    parallel through the trainer). The step's loss and gradients equal one process's (TOL)."""
    from parallelisms import clip_grad_norm_, loss_parallel_context
    from trainer.step.eager import EagerStep

    args = dataclasses.replace(_qwen3_args(), n_layers=1)  # one MoE block shows it
    torch.manual_seed(0)
    ref = Transformer(args)
    with torch.no_grad():
        ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    inputs, labels = batch(args.vocab_size, 2)
    want_lm = lm_loss(ref(inputs), labels)
    (want_lm + QWEN_AUX * ref.pop_aux_loss()).backward()
    want_lm, want_grads = want_lm.item(), {n: p.grad for n, p in ref.named_parameters()}

    def rank_fn():
        dims = ParallelDims(world_size=2, dp_shard=1, tp=2)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = Transformer(args)
        parallelize_model(
            model,
            plan=PLAN,
            parallel_dims=dims,
            mesh=mesh,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            enable_loss_parallel=True,
        )
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keeps the weights; the grads stay
        step = EagerStep(
            model=model, optimizer=optimizer, max_norm=0.0, aux_loss_coef=QWEN_AUX, clip_grad_norm=clip_grad_norm_
        )
        out = step([(inputs, labels)])
        return out.loss.item(), {n: full(p.grad) for n, p in model.named_parameters()}

    # loss_parallel() edits DTensor's global op table on enter and exit: with thread ranks it is
    # entered once, here (tests/unit/test_parallel_training.py does the same).
    with loss_parallel_context(True):
        results = run_threads(2, rank_fn)
    for lm, grads in results:
        assert lm == pytest.approx(want_lm, rel=1e-6)
        assert set(grads) == set(want_grads)
        for name, want in want_grads.items():
            assert rel_diff(grads[name], want) < TOL, name


# --- more ranks than experts, end to end (torchrun, gloo) ------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow  # ~1 min on 2 cores: one 4-process and two 1-process trainer runs
def test_experts_beyond_ranks_train_and_resume(tmp_path, monkeypatch):
    """The MoE debug recipe with 2 experts on 4 processes (dp_shard 4, ep 2: efsdp 2 > 1 local
    expert, experts sharded along their hidden dim) matches 1 process for 6 steps with the
    recipe's aux coefficient, and its step-3 DCP checkpoint resumes on 1 process.

    Tolerance 1e-5 relative on loss and aux loss: fp32 parameters, so the runs differ only by
    summation order (all-reduce / reduce-scatter of fp32 gradients, ~1e-7 relative per step),
    which AdamW's first steps amplify by at most ~10x over 6 steps.
    """
    from tests.e2e.test_qwen3_e2e import MOE, MOE_PARITY, max_rel_diff
    from tests.support.trainer_runs import REPO, train

    monkeypatch.chdir(REPO)
    common = [*MOE_PARITY, "--config", MOE, "--model.num_experts=2", "--training.steps=6"]
    ckpt = ["--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.keep_latest_k=0"]
    got = train(tmp_path / "ep2", 4, dict(dp_shard=4, ep=2), *common, *ckpt)
    want = train(tmp_path / "single", 1, {}, *common, "--checkpoint.enable=false")
    assert max_rel_diff(got, want, range(1, 7)) < 1e-5
    assert (
        max(abs(got[s]["moe_aux_loss"] - want[s]["moe_aux_loss"]) / want[s]["moe_aux_loss"] for s in range(1, 7)) < 1e-5
    )
    # The checkpoint holds the hidden-dim expert shards; DCP reshards them for 1 process.
    shutil.copytree(tmp_path / "ep2" / "checkpoints" / "step-3", tmp_path / "resume" / "checkpoints" / "step-3")
    resumed = train(tmp_path / "resume", 1, {}, *common, *ckpt)
    assert max_rel_diff({s: resumed[s] for s in (4, 5, 6)}, {s: got[s] for s in (4, 5, 6)}, (4, 5, 6)) < 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow  # two 2-process trainer runs, one of them compiling the scanned graph step
@pytest.mark.parametrize(
    "degrees",
    [
        pytest.param(dict(dp_shard=2), marks=pytest.mark.exhaustive),  # the fsdp2-ep2 point holds it
        dict(dp_shard=2, ep=2),
    ],
    ids=["fsdp2", "fsdp2-ep2"],
)
def test_moe_layer_scan_matches_eager(tmp_path, monkeypatch, degrees):
    """Graph mode with layer scan on 2 ranks (the global-batch load-balancing loss's count
    all-reduce runs inside the scan body; with ep 2 the static-shape padded dispatch does too)
    equals eager for 3 steps, loss and aux loss within 1e-5 relative (fp32; measured ~1e-7:
    summation order only)."""
    from tests.e2e.test_qwen3_e2e import MOE, MOE_PARITY, max_rel_diff
    from tests.support.trainer_runs import REPO, train

    monkeypatch.chdir(REPO)
    common = [*MOE_PARITY, "--config", MOE, "--training.steps=3", "--checkpoint.enable=false"]
    eager = train(tmp_path / "eager", 2, degrees, *common)
    scan = train(
        tmp_path / "scan",
        2,
        degrees,
        *common,
        "--compile.mode=graph",
        "--compile.backend=aot_eager",
        "--compile.scan_layers=true",
    )
    assert max_rel_diff(scan, eager, range(1, 4)) < 1e-5
    assert (
        max(abs(scan[s]["moe_aux_loss"] - eager[s]["moe_aux_loss"]) / eager[s]["moe_aux_loss"] for s in range(1, 4))
        < 1e-5
    )


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_scan_gather_along_any_dim(dim):
    """The layer-scan body's gather (parallelisms/scan.py `GatherShard`) along the dim an
    expert weight is sharded on: forward = the full tensor, backward = the mean of the ranks'
    gradients, cut to the rank's shard (exact: one all-gather / reduce-scatter of fp32)."""
    from parallelisms.scan import GatherShard

    world_size = 2
    full = torch.randn(2, 4, 6)
    grads = [torch.randn(2, 4, 6) for _ in range(world_size)]

    def rank_fn():
        rank = dist.get_rank()
        group = (dist.group.WORLD.group_name, world_size)
        shard = full.chunk(world_size, dim=dim)[rank].clone().requires_grad_()
        out = GatherShard.apply(shard, group, (), None, None, dim)
        out.backward(grads[rank])
        return out.detach(), shard.grad

    mean_grad = sum(grads) / world_size
    for rank, (out, grad) in enumerate(run_threads(world_size, rank_fn)):
        assert torch.equal(out, full)
        torch.testing.assert_close(grad, mean_grad.chunk(world_size, dim=dim)[rank], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", ["float8_tensorwise", "float8_rowwise", "int8"])
def test_quantized_experts_on_ep2_match_one_process_on_the_global_batch(recipe):
    """The routed experts under a `[quantize]` recipe (the op `quantized_grouped_mm`) on EP 2 (2
    thread ranks, each holding 4 of the 8 experts) against one process running both ranks' tokens
    as one batch: every expert's scale groups then hold the same tokens in both (the dispatch only
    moves rows), so the quantized values are equal and outputs, input gradients and every gradient
    agree to fp32 summation order (the tolerance of this file). Blockwise is left out: its
    128-token tiles of the weight gradient depend on the order of an expert's rows, which EP
    changes (rank-major), so it agrees only to its quantization error."""
    from parallelisms.quantize import apply_quantize

    world_size, dim, hidden = 2, 16, 32
    ref, xs, grads_out = _moe_case("random", world_size, dim, hidden)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    apply_quantize(ref, recipe=recipe, min_dim=0)
    moe_ref = ref.layers["0"].moe
    assert moe_ref.experts.recipe == recipe
    x_all = torch.cat(xs).clone().requires_grad_()
    out_all, _, _ = moe_ref(x_all)
    # the data-parallel gradient: the mean of the ranks' losses (the aux loss is left out here:
    # the quantized matmuls are the experts')
    ((out_all * torch.cat(grads_out)).sum() / world_size).backward()
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    plain = _Layers(dim, hidden)
    plain.load_state_dict(state)
    # the recipe is in effect: its outputs are the quantization error away from the unquantized
    assert rel_diff(out_all.detach(), plain.layers["0"].moe(torch.cat(xs))[0].detach()) > 1e-3

    def rank_fn():
        rank = dist.get_rank()
        model = _ep_layers(world_size, world_size, dim, hidden, state, recipe)
        moe = model.layers["0"].moe
        assert moe.experts.recipe == recipe
        x = xs[rank].clone().requires_grad_()
        out, _, _ = moe(x)
        (out * grads_out[rank]).sum().backward()
        return out.detach(), x.grad, {n: full(p.grad) for n, p in model.named_parameters()}

    for rank, (out, dx, grads) in enumerate(run_threads(world_size, rank_fn)):
        rows = slice(rank, rank + 1)
        assert rel_diff(out, out_all[rows].detach()) < TOL, rank
        assert rel_diff(dx, x_all.grad[rows] * world_size) < TOL, rank
        for name, want in want_grads.items():
            assert rel_diff(grads[name], want) < TOL, (rank, name)
