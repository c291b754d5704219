"""The pod planner on DeepSeek-V3 / Kimi K2 (planner/deepseek.py, docs/planner.md).

- The MLA + DeepSeek MoE activation model equals the bytes a real CPU forward of the debug
  flavor keeps for backward (`measure_saved_bytes`), every AC mode, with and without a q LoRA,
  with the attention op served as TPU splash serves it (q/k and v at their own widths; a CPU
  stand-in that saves what titan_kernels/tpu/register.py's splash op saves).
- The dense + MoE probe (one block per stack) shards exactly like the whole 671B model.
- `recommend` searches the expert-parallel degree, and the shipped pod recipes are its choice;
  both pass the recipe check's rules and memory half (`--no-capture`) on their targets.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import planner as P
from models import get_model_family
from models.errors import ConfigError
from parallelisms.activation_checkpoint import AC_MODES
from planner.deepseek import mla_activation_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSEEK = get_model_family("deepseek_v3")
RECIPES = {"deepseek_v3_671b_v7x": ("v7x-512", 64, 4), "kimi_k2_v7x": ("v7x-1024", 64, 4)}
"""recipe -> (target, expert-parallel degree, local batch) the planner chose (docs/planner.md)."""


@pytest.fixture
def splash_stand_in():
    """Serve `causal_attention` with a CPU op that keeps for the backward what TPU splash keeps
    (titan_kernels/tpu/register.py): q, k, v as contiguous [b, h, s, width] copies at their own
    widths (no padding), the output [b, h, s, v] and the fp32 log-sum-exp [b, h, s]; selective
    AC saves its outputs as it saves splash's (`titan_kernels.saved_ops`). The values are the
    reference's; only what stays alive is splash's."""
    import titan_kernels
    from models.common import ops

    name = "titan_test_planner::splash_like"
    if not hasattr(torch.ops.titan_test_planner, "splash_like"):

        @torch.library.custom_op(name, mutates_args=())
        def splash_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            n_rep = q.shape[1] // k.shape[1]
            kr = ops.repeat_kv(k, n_rep).float()
            scores = (q.float() @ kr.transpose(-2, -1)) * q.shape[-1] ** -0.5
            seq = q.shape[2]
            scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
            lse = scores.logsumexp(-1)
            out = (scores - lse[..., None]).exp() @ ops.repeat_kv(v, n_rep).float()
            return out.to(q.dtype), lse

        @splash_like.register_fake
        def _(q, k, v):
            return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)

        def setup(ctx, inputs, output):
            ctx.save_for_backward(*inputs, *output)

        def backward(ctx, dout, dlse):
            q, k, v, _, _ = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = ops.sdpa_causal_attention(*leaves)
            return torch.autograd.grad(out, leaves, dout)

        splash_like.register_autograd(backward, setup_context=setup)
    op = torch.ops.titan_test_planner.splash_like.default

    def attention(q, k, v, segment_ids=None):
        assert segment_ids is None
        return op(q.contiguous(), k.contiguous(), v.contiguous())[0]

    ops.register("causal_attention", attention)
    titan_kernels.saved_ops().add(op)
    yield
    titan_kernels.saved_ops().discard(op)
    ops.register("causal_attention", None)


@pytest.mark.parametrize("ac_mode", AC_MODES)
@pytest.mark.parametrize("q_lora_rank", [64, 0], ids=["q-lora", "full-rank-q"])
def test_mla_activation_model_matches_measured_saved_bytes(ac_mode, q_lora_rank, splash_stand_in):
    """Predicted saved activations + kept bf16 weights vs a real forward + loss of the debug flavor
    (2 dense + 3 MoE blocks, 8 experts in 4 groups, top-2, one shared expert; the attention op
    as splash serves it on TPU: `splash_stand_in`) on one rank.

    Tolerance: the formulas count every per-token tensor (docs/planner.md), so they must agree to
    the byte except for what is not per token: the sequence-wise balance loss keeps a few [E] and
    [batch, E] fp32 tensors per MoE block (counts, frequencies: 4E x batch + under 128 bytes),
    which the model leaves out. The bound is that, per MoE block: 0.003 % of the total here,
    and it cannot hide a missing per-token term (the smallest, a fp32 rsqrt, is 4 x 128 tokens
    per block)."""
    from trainer.step import lm_loss

    batch, seq = 2, 64
    args = dataclasses.replace(DEEPSEEK.flavors["debugmodel"], max_seq_len=seq, q_lora_rank=q_lora_rank)
    shape = args.shape()
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with P.fake_process_group(1):
        dims = P.make_parallel_dims(dp_replicate=1, dp_shard=-1, tp=1, ep=1, world_size=1, shape=shape, seq_len=seq)
        stats = P.shard_model(DEEPSEEK, args, dims)
        acts = mla_activation_bytes(args, local_batch_size=batch, seq_len=seq, tp=1, ac_mode=ac_mode)
        est = P.estimate(
            model="deepseek_v3",
            target=P.parse_target("v6e-4"),
            shape=shape,
            stats=stats,
            parallel_dims=dims,
            local_batch_size=batch,
            seq_len=seq,
            ac_mode=ac_mode,
            loss_parallel=False,
            flops_per_token=1.0,
            activations=acts,
        )
        model = P.build_parallel_model(DEEPSEEK, args, dims, ac_mode=ac_mode)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        measured = P.measure_saved_bytes(model, tokens[:, :-1], tokens[:, 1:], loss_fn=lm_loss)
    predicted = est.activations.total + est.saved_weights
    n_moe = args.n_layers - args.n_dense_layers
    bound = n_moe * (4 * args.num_experts * batch + 128) if ac_mode == "none" else 16
    assert 0 <= measured - predicted <= bound, (predicted, measured)


def test_dense_and_moe_blocks_are_counted_per_stack():
    """The two stacks differ: `blocks` sums 3 dense and 58 MoE blocks, `per_block_none` is the
    larger (MoE) block; full AC keeps the block input (2 x dim bytes per token) in both."""
    args = DEEPSEEK.flavors["671B"]
    t = 4096
    none = mla_activation_bytes(args, local_batch_size=1, seq_len=t, tp=1, ac_mode="none")
    full = mla_activation_bytes(args, local_batch_size=1, seq_len=t, tp=1, ac_mode="full")
    assert full.blocks == 61 * 2 * args.dim * t
    dense_moe = none.blocks - 58 * none.per_block_none
    assert 0 < dense_moe < none.per_block_none * 3  # 3 dense blocks, each smaller than a MoE block
    for key, value in (("tensor_parallel_degree", dict(tp=2)), ("context_parallel_degree", dict(cp=2))):
        kw = dict(local_batch_size=1, seq_len=t, tp=1, ac_mode="full") | value
        with pytest.raises(ConfigError, match=f"parallelism.{key}: 2: .*allowed: 1"):
            mla_activation_bytes(args, **kw)


def test_dense_moe_probe_shards_like_the_whole_model():
    """One dense + one MoE block, each times its stack's length, gives the 671B model's shard
    sizes exactly (FSDP 512 x EP 4 on a fake world), in a tenth of the time."""
    args = dataclasses.replace(DEEPSEEK.flavors["671B"], max_seq_len=4096)
    shape = args.shape()
    with P.fake_process_group(512):
        dims = P.make_parallel_dims(dp_replicate=1, dp_shard=-1, tp=1, ep=4, world_size=512, shape=shape, seq_len=4096)
        whole = P.shard_model(DEEPSEEK, args, dims)
        probed = P.shard_model(DEEPSEEK, args, dims, probe=True)
    assert probed.probed and not whole.probed
    for field in (
        "root_numel",
        "blocks_numel",
        "block_gathered_numel",
        "blocks_gathered_numel",
        "largest_block_param_gathered",
        "lm_head_gathered_numel",
    ):
        assert getattr(probed, field) == getattr(whole, field), field


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_pod_recipe_is_the_planners_choice_and_passes_the_check(recipe):
    """`recommend` (EP searched for MoE models) picks the recipe's EP degree, batch and AC mode
    on its target, and the recipe check's rules + memory half passes there."""
    from tools.recipe_check import check_recipe, plan_inputs
    from trainer.config import build_config

    path = os.path.join(ROOT, "configs", f"{recipe}.toml")
    cfg = build_config(path)
    target, ep, batch = RECIPES[recipe]
    assert cfg.job.target == target
    best = P.recommend(plan_inputs(cfg), P.parse_target(target))[0]
    p = cfg.parallelism
    assert best.fits and (best.ep, best.local_batch_size, best.ac_mode, best.tp, best.cp) == (
        p.expert_parallel_degree,
        cfg.training.local_batch_size,
        cfg.activation_checkpoint.mode,
        1,
        1,
    )
    assert (best.ep, best.local_batch_size) == (ep, batch)
    r = check_recipe(path, capture=False)
    assert r.ok, r.error
    assert abs(r.planned_gib - best.total / P.GiB) < 1e-6 and r.planned_gib < r.hbm_gib
