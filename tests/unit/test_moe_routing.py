"""Benchmark routing (`[moe] routing`, models/common/moe.py, docs/moe.md#benchmark-routing).

- random: a pure function of (seed, step, layer, global token index): the same draw twice, a new
  one for another step or layer, k distinct experts per token, close to uniform loads; its hash
  gives the same bits in int32 (as XLA runs it, products wrapping) as in int64 (CPU), for keys
  and token indices up to 2^31 - 1 (the XLA side: tests/xla/test_moe_xla.py);
- balanced: k distinct experts per token and exactly equal expert counts;
- both keep the router in the autograd graph (the gate still gets a gradient) and leave the
  learned router's module tree and state dict alone;
- mesh independence: one process on the global batch and 2 ranks (threads, gloo) with EP 2 x
  FSDP 2, each on its half, send every token to the same experts (and so reach the same loss);
  and the trainer end to end, 1 process vs torchrun 2 processes (gloo) with EP 2: the same losses;
- the per-step key reaches a captured, layer-scanned graph step: its losses equal eager's;
- the step plan's rules refuse random / balanced outside a recipe marked a benchmark, on a model
  without experts, and where the draw's token index is not implemented (TP, CP, accumulation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.common.moe import MoE, _mix31, balanced_experts, random_experts, routing_key, set_routing_key, use_routing
from models.errors import ConfigError
from models.qwen3 import FLAVORS, Transformer
from models.qwen3.plan import PLAN
from parallelisms import ParallelDims, build_mesh, parallelize_model
from tests.support.parallel_harness import SEQ_LEN, batch, lm_loss, load_full_state, run_threads
from trainer.step.plan import StepRequest, plan_step, refusals


def _draw(key: int, first: int, n: int, e: int = 8, k: int = 2) -> torch.Tensor:
    return random_experts(torch.tensor(key), first + torch.arange(n), e, k)


def test_random_routing_is_a_function_of_key_and_token():
    key = routing_key(seed=42, step=3, layer=1)
    a = _draw(key, 0, 4096)
    assert torch.equal(a, _draw(key, 0, 4096))
    # The same tokens drawn in two pieces (two ranks' halves) are the same draw.
    assert torch.equal(a, torch.cat([_draw(key, 0, 2048), _draw(key, 2048, 2048)]))
    for other in (
        routing_key(seed=42, step=4, layer=1),
        routing_key(seed=42, step=3, layer=2),
        routing_key(seed=7, step=3, layer=1),
    ):
        assert (a != _draw(other, 0, 4096)).any(dim=1).float().mean() > 0.5
    # k distinct experts per token, every expert near its share (4096 x 2 / 8 = 1024).
    assert (a[:, 0] != a[:, 1]).all()
    counts = torch.bincount(a.flatten(), minlength=8)
    assert ((counts - 1024).abs() < 120).all(), counts


@pytest.mark.parametrize("num_experts, top_k", [(2, 2), (384, 8), (1000, 16)])
def test_random_routing_picks_distinct_experts_at_any_width(num_experts, top_k):
    chosen = _draw(routing_key(seed=0, step=1, layer=0), 0, 256, num_experts, top_k)
    assert ((chosen >= 0) & (chosen < num_experts)).all()
    assert all(len(set(row.tolist())) == top_k for row in chosen)


def test_random_routing_is_the_same_in_int32_and_int64():
    """XLA runs the draw in int32 (jax without 64-bit types): products wrap mod 2^32 there and are
    exact in int64 here; the 31-bit hash must give the same bits either way, and the key and sort
    key must fit int32. Over 12 keys per width, first tokens up to 2^31 - N and the shipped
    widths, every row the same; the hash alone on 10^5 arbitrary int64 inputs (any sign) too."""
    g = torch.Generator().manual_seed(0)
    for num_experts, top_k in [(2, 2), (8, 2), (60, 4), (128, 8), (256, 8), (384, 8), (1000, 16)]:
        for case in range(12):
            key = routing_key(seed=case, step=3 * case + 1, layer=case % 7)
            assert 0 <= key < 2**31
            first = int(torch.randint(0, 2**31 - 512, (), generator=g)) if case % 4 else 2**31 - 512
            tokens = first + torch.arange(512)
            want = random_experts(torch.tensor(key), tokens, num_experts, top_k)
            got = random_experts(torch.tensor(key, dtype=torch.int32), tokens.int(), num_experts, top_k)
            assert torch.equal(got, want), (num_experts, top_k, case)
    x = torch.randint(-(2**63), 2**63 - 1, (100_000,), dtype=torch.int64, generator=g)
    mixed = _mix31(x)
    assert ((mixed >= 0) & (mixed < 2**31)).all()
    assert torch.equal(_mix31(x.int()).long(), mixed)  # int32 wraps: the low 31 bits of the input agree
    # A key near 2^31 uses the top bit: the keys of 2000 (seed, step) spread over [0, 2^31).
    keys = torch.tensor([routing_key(seed=s, step=s % 13, layer=s % 3) for s in range(2000)])
    assert keys.max() >= 2**31 - 2**24 and (keys >= 2**30).float().mean().item() == pytest.approx(0.5, abs=0.05)


def test_random_routing_is_uniform_at_moe_widths():
    """Every expert near its share at DeepSeek-V3's width (256 experts, top 8): 16,384 tokens give
    512 copies per expert, binomial sd sqrt(512 x 255/256) = 22.6; 5 sd = 113 bounds all 256 with
    a false alarm below 256 x 6e-7. Each slot's expert (the top-1 alone) near uniform too."""
    chosen = _draw(routing_key(seed=1, step=2, layer=3), 2**31 - 16_384, 16_384, 256, 8)
    counts = torch.bincount(chosen.flatten(), minlength=256)
    assert ((counts - 512).abs() < 113).all(), counts
    first = torch.bincount(chosen[:, 0], minlength=256)  # 64 per expert, sd 8: 5 sd = 40
    assert ((first - 64).abs() < 40).all(), first


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (8, 8), (6, 4)])
def test_balanced_routing_gives_equal_counts(num_experts, top_k):
    num_tokens = 3 * num_experts  # copies a multiple of E
    chosen = balanced_experts(torch.arange(num_tokens) + 5 * num_experts, num_experts, top_k)
    assert all(len(set(row.tolist())) == top_k for row in chosen)
    counts = torch.bincount(chosen.flatten(), minlength=num_experts)
    assert (counts == num_tokens * top_k // num_experts).all(), counts


@pytest.mark.parametrize("routing", ["random", "balanced"])
def test_router_keeps_its_gradient_and_learned_state(routing):
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=32, num_experts=8, top_k=2, norm_topk_prob=True)
    keys = set(moe.state_dict())
    assert use_routing(moe, routing) == 1
    assert set(moe.state_dict()) == keys  # the key buffer is not persistent: checkpoints unchanged
    set_routing_key(moe, seed=0, step=1, first_token=0)
    out, aux, load = moe(torch.randn(2, 8, 16))
    (out.square().mean() + aux).backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    if routing == "balanced":
        assert torch.equal(load, torch.full((8,), 4.0))


def test_learned_routing_is_unchanged():
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=32, num_experts=8, top_k=2, norm_topk_prob=True)
    x = torch.randn(2, 8, 16)
    want = moe(x)[0]
    use_routing(moe, "learned")
    assert "routing_key" not in dict(moe.named_buffers())
    assert torch.equal(moe(x)[0], want)


def _args():
    return dataclasses.replace(FLAVORS["debugmodel_moe"], n_layers=2, max_seq_len=SEQ_LEN, num_experts=8)


def _experts_seen(model) -> list[torch.Tensor]:
    """Hooks that record every router's chosen experts [N, k] per forward, in layer order."""
    seen: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, MoE):
            module.router.register_forward_hook(lambda m, args, out: seen.append(out[1].clone()))
    return seen


@pytest.mark.parametrize("routing", ["random", "balanced"])
def test_routing_is_the_same_on_one_process_and_ep2(routing):
    global_batch, step, seed = 4, 7, 42
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Transformer(_args())
    use_routing(ref, routing)
    ref.to_empty(device="cpu")
    with torch.no_grad():
        ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    set_routing_key(ref, seed=seed, step=step, first_token=0)
    seen = _experts_seen(ref)
    inputs, labels = batch(ref.args.vocab_size, global_batch)
    want_loss = lm_loss(ref(inputs), labels).item()
    want = [s.view(global_batch, SEQ_LEN, -1) for s in seen]

    def rank_fn():
        dims = ParallelDims(world_size=2, dp_shard=2, ep=2)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = Transformer(_args())
        use_routing(model, routing)
        parallelize_model(
            model, plan=PLAN, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
        )
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        r, n = dims.dp_rank(mesh), global_batch // dims.dp_degree
        set_routing_key(model, seed=seed, step=step, first_token=r * n * SEQ_LEN)
        rank_seen = _experts_seen(model)
        loss = lm_loss(model(inputs[r * n : (r + 1) * n]), labels[r * n : (r + 1) * n]).item()
        return r, n, loss, rank_seen

    results = run_threads(2, rank_fn)
    for r, n, _, rank_seen in results:
        assert len(rank_seen) == len(want) == 2
        for layer, got in enumerate(rank_seen):
            assert torch.equal(got.view(n, SEQ_LEN, -1), want[layer][r * n : (r + 1) * n]), (r, layer)
    assert not torch.equal(want[0], want[1]) or routing == "balanced"  # layers draw apart
    assert sum(loss for *_, loss, _ in results) / 2 == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow  # ~35 s on 2 cores: one 1-process and one 2-process trainer run
def test_trainer_random_routing_1_process_equals_ep2(tmp_path, monkeypatch):
    """The trainer end to end (`[moe] routing = "random"`, the key written by `Job.before_step`
    each step): 1 process vs 2 processes (torchrun, gloo) with FSDP 2 x EP 2, the same losses."""
    from tests.support.trainer_runs import MOE_SHORT_RUN, REPO, assert_losses_close, train_losses

    monkeypatch.chdir(REPO)
    args = [*MOE_SHORT_RUN, "--moe.routing=random", "--moe.routing_benchmark_only=true"]
    want = train_losses(tmp_path / "one", 1, {}, 3, *args)
    got = train_losses(tmp_path / "ep2", 2, dict(dp_shard=2, ep=2), 3, *args)
    assert_losses_close(got, want)


@pytest.mark.slow  # ~40 s on 2 cores: an eager and a graph-mode (layer scan) trainer run
def test_trainer_random_routing_scanned_graph_equals_eager(tmp_path, monkeypatch):
    """The key buffer reaches a captured, layer-scanned step anew each step (stacked per layer,
    written in place by `Job.before_step`): graph mode with scan gives eager's losses."""
    from tests.support.trainer_runs import MOE_SHORT_RUN, REPO, assert_losses_close, train_losses

    monkeypatch.chdir(REPO)
    args = [*MOE_SHORT_RUN, "--moe.routing=random", "--moe.routing_benchmark_only=true"]
    want = train_losses(tmp_path / "eager", 1, {}, 3, *args)
    got = train_losses(
        tmp_path / "graph",
        1,
        {},
        3,
        *args,
        "--compile.mode=graph",
        "--compile.scan_layers=true",
        "--compile.backend=aot_eager",
    )
    assert_losses_close(got, want)


def test_rules_refuse_routing_outside_benchmarks():
    bench = dict(routing_benchmark_only=True)
    assert refusals(StepRequest()) == []
    assert refusals(StepRequest(moe_routing="random", **bench)) == []
    assert refusals(StepRequest(moe_routing="balanced", **bench)) == []
    cases = {
        "train": StepRequest(moe_routing="random"),
        "dense": StepRequest(moe_routing="balanced", model_has_experts=False, **bench),
        "choice": StepRequest(moe_routing="top1"),
        "tp": StepRequest(moe_routing="random", tp_degree=2, **bench),
        "cp": StepRequest(moe_routing="random", cp_degree=2, model_document_mask=True, **bench),
        "accum": StepRequest(moe_routing="balanced", grad_accum=2, **bench),
        "engine": StepRequest(moe_routing="random", caller_loss=True, **bench),
    }
    for name, request in cases.items():
        messages = refusals(request)
        assert len(messages) == 1 and messages[0].startswith("moe.routing: "), (name, messages)
        assert "allowed" in messages[0], messages
    assert "routing_benchmark_only = true" in refusals(cases["train"])[0]
    with pytest.raises(ConfigError, match="moe.routing"):
        plan_step(cases["train"])


@pytest.mark.parametrize(
    "recipe, overrides, refused",
    [
        ("configs/qwen3_moe_debug.toml", ["moe.routing=random"], "benchmarks only"),
        ("configs/qwen3_moe_debug.toml", ["moe.routing=random", "moe.routing_benchmark_only=true"], None),
        ("configs/deepseek_v3_debug.toml", ["moe.routing=balanced", "moe.routing_benchmark_only=true"], None),
        ("configs/qwen3_debug.toml", ["moe.routing=balanced", "moe.routing_benchmark_only=true"], "has none"),
        (
            "configs/qwen3_moe_debug.toml",
            ["moe.routing=random", "moe.routing_benchmark_only=true", "training.gradient_accumulation_steps=2"],
            "accumulation",
        ),
        ("configs/qwen3_moe_debug.toml", ["moe.routing=learned", "training.gradient_accumulation_steps=2"], None),
    ],
)
def test_plan_job_reads_the_moe_section(recipe, overrides, refused):
    """The recipe's `[moe]` section reaches the rules through `plan_job` (the trainer's step 2)."""
    from trainer.config import build_config, parse_overrides
    from trainer.job import plan_job

    cfg = build_config(recipe, parse_overrides([f"--{o}" for o in overrides]))
    if refused is None:
        plan_job(cfg, world_size=1, device_type="cpu")
    else:
        with pytest.raises(ConfigError, match=f"^moe.routing: .*{refused}"):
            plan_job(cfg, world_size=1, device_type="cpu")
