"""SimpleFSDP: shard layout, gradients vs one process, mixed precision, init, memory, clipping.

Ranks are threads (see test_parallel_harness.py); models are the real Llama 3 / Qwen 3
debug flavors with 2 layers and 16-token sequences.
"""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from parallelisms import (
    ParallelDims,
    build_mesh,
    clip_grad_norm_,
    disable_active_parametrization,
    local_bytes,
    parallelize_model,
)
from tests.support.parallel_harness import (
    FAMILIES,
    LLAMA3_PLAN,
    RNG_LOCK,
    Llama3,
    batch,
    full,
    llama3_args,
    lm_loss,
    load_full_state,
    reference_state,
    rel_diff,
    run_threads,
)

FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)


def _parallel_model(family: str, world_size: int, degrees: dict, **kwargs):
    """Meta model -> parallelize -> to_empty; returns (model, dims, mesh). Call on a rank."""
    cls, make_args, plan = FAMILIES[family]
    dims = ParallelDims(world_size=world_size, **degrees)
    mesh = build_mesh(dims, "cpu") if world_size > 1 else None
    with torch.device("meta"):
        model = cls(kwargs.pop("args", None) or make_args())
    parallelize_model(model, plan=plan, parallel_dims=dims, mesh=mesh, **kwargs)
    model.to_empty(device="cpu")
    with RNG_LOCK, torch.no_grad():  # also rebuilds the RoPE buffers; threads share the RNG
        torch.manual_seed(0)
        model.init_weights()
    return model, dims, mesh


def _reference_grads(family: str, state, inputs, labels):
    cls, make_args, _ = FAMILIES[family]
    model = cls(make_args())
    model.load_state_dict(state, strict=False)
    loss = lm_loss(model(inputs), labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_shard_layout():
    """Shapes and placements of stored parameters, on the meta device (no data needed)."""

    def rank_fn(degrees):
        dims = ParallelDims(world_size=4, **degrees)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = Llama3(llama3_args())
        parallelize_model(model, plan=LLAMA3_PLAN, parallel_dims=dims, mesh=mesh)
        params = dict(model.named_parameters())
        return {
            name: (tuple(params[name].placements), tuple(params[name].to_local().shape))
            for name in (
                "layers.0.attention.wq.weight",
                "layers.0.attention.wo.weight",
                "layers.0.attention_norm.weight",
                "tok_embeddings.weight",
            )
        }

    # dim 256, vocab 4096
    fsdp = run_threads(4, lambda: rank_fn(dict(dp_shard=4)))[1]
    assert fsdp["layers.0.attention.wq.weight"] == ((Shard(0),), (64, 256))
    assert fsdp["layers.0.attention_norm.weight"] == ((Shard(0),), (64,))
    hsdp = run_threads(4, lambda: rank_fn(dict(dp_replicate=2, dp_shard=2)))[3]
    assert hsdp["layers.0.attention.wq.weight"] == ((Replicate(), Shard(0)), (128, 256))
    two_d = run_threads(4, lambda: rank_fn(dict(dp_shard=2, tp=2)))[2]
    # colwise: TP splits rows first, FSDP splits the TP shard again -> _StridedShard
    assert two_d["layers.0.attention.wq.weight"] == ((_StridedShard(0, split_factor=2), Shard(0)), (64, 256))
    assert two_d["layers.0.attention.wo.weight"] == ((Shard(0), Shard(1)), (128, 128))  # rowwise
    assert two_d["layers.0.attention_norm.weight"] == ((Shard(0), Replicate()), (128,))
    assert two_d["tok_embeddings.weight"] == ((_StridedShard(0, split_factor=2), Shard(0)), (1024, 256))


@pytest.mark.parametrize(
    "family, degrees",
    [
        ("llama3", dict(dp_shard=4)),
        ("llama3", dict(dp_replicate=2, dp_shard=2)),
        ("llama3", dict(dp_shard=2, tp=2)),
        ("qwen3", dict(dp_shard=1, tp=4)),  # q_norm / k_norm on head-sharded activations
    ],
)
def test_grads_match_single_process(family, degrees):
    """Each dp rank takes its slice of the global batch; the averaged grads are the full-batch grads."""
    state = reference_state(family)
    inputs, labels = batch(FAMILIES[family][1]().vocab_size)
    ref_loss, ref_grads = _reference_grads(family, state, inputs, labels)

    def rank_fn():
        model, dims, mesh = _parallel_model(family, 4, degrees, **FP32)
        load_full_state(model, state)
        dp_rank = dims.dp_rank(mesh)
        loss = lm_loss(model(inputs.chunk(dims.dp_degree)[dp_rank]), labels.chunk(dims.dp_degree)[dp_rank])
        loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        placements = {n: p.grad.placements == p.placements for n, p in model.named_parameters()}
        return loss.detach(), grads, placements

    results = run_threads(4, rank_fn)
    # every dp group has the same number of TP ranks, so the mean over ranks is the dp mean
    mean_loss = torch.stack([r[0] for r in results]).mean()
    assert rel_diff(mean_loss, ref_loss) < 1e-5
    for _, grads, placements in results:
        assert all(placements.values()), "gradients must be sharded like their parameters"
        assert grads.keys() == ref_grads.keys()
        worst = max(rel_diff(grads[n], ref_grads[n]) for n in grads)
        assert worst < 1e-5, worst


@pytest.mark.parametrize("world_size, degrees", [(2, dict(dp_shard=2)), (4, dict(dp_shard=2, tp=2))])
def test_tied_embeddings_stay_tied(world_size, degrees):
    """Llama 3.2-style tied embedding/output: one parameter after TP and SimpleFSDP; its
    gradient is the sum of both uses, as in one process."""
    args = dataclasses.replace(llama3_args(), tie_embeddings=True)
    cls = FAMILIES["llama3"][0]
    ref = cls(args)
    with torch.no_grad():
        torch.manual_seed(0)
        ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    inputs, labels = batch(4096)
    lm_loss(ref(inputs), labels).backward()
    ref_grad = ref.tok_embeddings.weight.grad

    def rank_fn():
        model, dims, mesh = _parallel_model("llama3", world_size, degrees, args=args, **FP32)
        load_full_state(model, state)
        rank = dims.dp_rank(mesh)
        lm_loss(model(inputs.chunk(dims.dp_degree)[rank]), labels.chunk(dims.dp_degree)[rank]).backward()
        shared = model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]
        return (
            shared,
            len(list(model.parameters())),
            "output.weight" in model.state_dict(),
            rel_diff(full(model.tok_embeddings._parameters["weight"].grad), ref_grad),
        )

    for shared, num_params, key, grad_diff in run_threads(world_size, rank_fn):
        assert shared and num_params == 2 * 9 + 2 and key  # 2 blocks x 9, embedding, norm
        assert grad_diff < 1e-5


def test_state_dict_keys_and_paths_unchanged():
    """TP + AC + compile + SimpleFSDP keep every module path and state-dict key."""
    plain = Llama3(llama3_args())
    keys, modules = list(plain.state_dict()), [n for n, _ in plain.named_modules()]

    def rank_fn():
        model, _, _ = _parallel_model(
            "llama3", 4, dict(dp_shard=2, tp=2), ac_mode="selective", compile_backend="aot_eager"
        )
        return (
            list(model.state_dict()),
            [n for n, _ in model.named_modules()],
            list(get_model_state_dict(model)),
            [n for n, _ in model.named_parameters()],
        )

    for sd_keys, paths, dcp_keys, param_names in run_threads(4, rank_fn):
        assert sd_keys == keys and paths == modules
        assert dcp_keys == keys and param_names == keys


def test_meta_init_matches_single_process():
    """A seed gives the same weights on a 2-D mesh as in one process (CPU: full-size init)."""
    state = reference_state("llama3", seed=7)

    def rank_fn():
        model, _, _ = _parallel_model("llama3", 4, dict(dp_shard=2, tp=2))
        with RNG_LOCK, torch.no_grad():
            torch.manual_seed(7)
            model.init_weights()
        return max(rel_diff(full(p), state[n]) for n, p in model.named_parameters())

    assert run_threads(4, rank_fn) == [0.0] * 4


def test_mixed_precision_bf16_compute_fp32_master():
    state = reference_state("llama3")
    inputs, labels = batch(4096)
    ref_loss, ref_grads = _reference_grads("llama3", state, inputs, labels)

    def rank_fn():
        world = 2 if torch.distributed.get_world_size() == 2 else 1
        model, dims, mesh = _parallel_model(
            "llama3", world, dict(dp_shard=world), param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        load_full_state(model, state)
        wq = model.layers["0"].attention.wq
        assert wq._parameters["weight"].dtype == torch.float32  # master weight
        assert wq.weight.dtype == torch.bfloat16  # what forward computes with
        with disable_active_parametrization(model):
            assert wq.weight is wq._parameters["weight"]
        rank = dims.dp_rank(mesh)
        logits = model(inputs.chunk(world)[rank])
        loss = lm_loss(logits, labels.chunk(world)[rank])
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        return logits.dtype, loss.detach(), grads

    for world in (1, 2):  # 1: single process, cast only; 2: gathered in bf16, reduced in fp32
        results = run_threads(world, rank_fn)
        assert all(r[0] == torch.bfloat16 for r in results)
        loss = torch.stack([r[1] for r in results]).mean()
        assert rel_diff(loss, ref_loss) < 1e-2
        grads = results[0][2]
        assert max(rel_diff(grads[n], ref_grads[n]) for n in grads) < 0.05


def test_memory_per_rank_scales_as_one_over_dp_shard():
    """Params + grads + AdamW state bytes per rank: dp_shard=N holds 1/N of one process."""
    inputs, labels = batch(4096, batch_size=4)

    def rank_fn():
        world = torch.distributed.get_world_size()
        model, dims, mesh = _parallel_model("llama3", world, dict(dp_shard=world), **FP32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        rank = dims.dp_rank(mesh)
        lm_loss(model(inputs.chunk(world)[rank]), labels.chunk(world)[rank]).backward()
        opt.step()
        params = list(model.parameters())
        state = [t for s in opt.state.values() for t in s.values() if t.ndim > 0]
        return local_bytes(params) + local_bytes(p.grad for p in params) + local_bytes(state)

    one = run_threads(1, rank_fn)[0]
    # fp32 parameter, gradient, exp_avg, exp_avg_sq
    assert one == 4 * 4 * sum(p.numel() for p in Llama3(llama3_args()).parameters())
    for n in (2, 4):
        per_rank = run_threads(n, rank_fn)
        assert all(b * n == one for b in per_rank), (one, per_rank)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_matches_single_process(norm_type):
    state = reference_state("llama3")
    inputs, labels = batch(4096)
    cls, make_args, _ = FAMILIES["llama3"]
    ref = cls(make_args())
    ref.load_state_dict(state, strict=False)
    lm_loss(ref(inputs), labels).backward()
    extra = torch.nn.Parameter(torch.ones(3))  # a plain (non-DTensor) parameter mixed in
    extra.grad = torch.full((3,), 0.5)
    ref_params = [*ref.parameters(), extra]
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_params], norm_type)
    max_norm = 0.5 * ref_norm.item()
    torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def rank_fn():
        model, _, _ = _parallel_model("llama3", 4, dict(dp_shard=2, tp=2), **FP32)
        load_full_state(model, state)
        # every rank sees the full batch: without dp slicing the grads equal the reference
        lm_loss(model(inputs), labels).backward()
        mine = torch.nn.Parameter(torch.ones(3))
        mine.grad = torch.full((3,), 0.5)
        total = clip_grad_norm_([*model.parameters(), mine], max_norm, norm_type)
        assert not isinstance(total, DTensor)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        return total, grads, mine.grad

    for total, grads, mine in run_threads(4, rank_fn):
        assert rel_diff(total, ref_norm) < 1e-5
        assert max(rel_diff(grads[n], ref_grads[n]) for n in grads) < 1e-5
        assert torch.allclose(mine, extra.grad)


def test_dcp_checkpoint_reshards_between_meshes(tmp_path):
    """Saved from FSDP x TP (2-D, _StridedShard), loaded into FSDP on 4 ranks: same weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = reference_state("llama3", seed=5)

    def save():
        model, _, _ = _parallel_model("llama3", 4, dict(dp_shard=2, tp=2))
        load_full_state(model, state)
        dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp_path))

    def load():
        model, _, _ = _parallel_model("llama3", 4, dict(dp_replicate=2, dp_shard=2))
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=str(tmp_path))
        set_model_state_dict(model, sd)
        return max(rel_diff(full(p), state[n]) for n, p in model.named_parameters())

    run_threads(4, save)
    assert run_threads(4, load) == [0.0] * 4
