"""gpt-oss family: HF logits parity, HF round trips, published sizes, EP/TP against one process,
the attention-backend rule, and the debug recipe training in-process.

Parity bound (fp32): ours and transformers' `GptOssForCausalLM` (eager attention, eager experts)
compute the same math in different orders: grouped expert matmuls vs HF's per-expert loop, the k
routed outputs summed in choice order vs HF's expert order, the top-k weights as a softmax over all
experts renormalised over the k vs HF's softmax over the k logits (equal in exact arithmetic, a few
ulps apart in fp32). fp32 eps is 1.2e-7; a matmul of K <= 64 terms moves a result by about
sqrt(K) eps ~ 1e-6 relative, and 4 blocks plus the output projection compound a few of those. We
bound the max logit difference by 1e-5 x max |logit| (the DeepSeek-V3 test's bound; measured:
about 4e-7, docs/models.md), while a missing sink, a window that is not applied, an unclamped
SwiGLU or swapped gate/up columns move logits by 1e-2 or more (the sensitivity checks below).
"""

import dataclasses

import pytest
import torch
import transformers  # the [dev] extra

import models
from models.gpt_oss import FLAVORS, GptOssTransformer
from models.gpt_oss import hf_adapter as gpt_oss_hf
from models.gpt_oss.plan import PLAN
from trainer.step.plan import StepRequest, refusals

REL_TOL = 1e-5
SEQ = 40  # longer than the test windows (8), so sliding layers drop keys


def _args(**kw):
    base = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=160,
        sliding_window=8,
        num_experts=8,
        num_experts_per_tok=4,
        moe_hidden_dim=32,
        max_seq_len=64,
    )
    return dataclasses.replace(FLAVORS["debugmodel"], **{**base, **kw})


def _hf_model(args):
    # max_position_embeddings = factor x original context only to keep transformers' YaRN
    # consistency warning quiet; the tables do not depend on it.
    cfg = {**gpt_oss_hf.hf_config(args), "max_position_embeddings": int(args.rope_factor * 4096)}
    config = transformers.GptOssConfig(**cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # norm weights away from 1, so a misplaced norm shows
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 1 or name.endswith("_bias"):  # biases, router bias and sinks: clearly nonzero
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _ours(args, hf_model):
    model = GptOssTransformer(args).eval()
    model.init_weights()
    model.load_state_dict(gpt_oss_hf.from_hf(hf_model.state_dict(), args), strict=True)
    return model


def _tokens(args, seqlen=SEQ):
    return torch.randint(0, args.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kw",
    [{}, dict(n_kv_heads=1, num_experts_per_tok=2, swiglu_limit=0.3)],
    ids=["top4", "mqa_top2_clamped"],
)
def test_logits_match_transformers(kw):
    """Sinks, alternating sliding (window 8 < seq 40) / full layers, GQA, YaRN (factor 32, no
    truncation), router bias, expert biases, clamped SwiGLU (limit 0.3: the clamp bites)."""
    args = _args(**kw)
    hf_model = _hf_model(args)
    ours = _ours(args, hf_model)
    tokens = _tokens(args)
    with torch.no_grad():
        want = hf_model(tokens).logits
        got = ours(tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (got - want).abs().max().item()
    assert diff <= REL_TOL * scale, (diff, scale)

    # The same experts for the same hidden states.
    x = torch.randn(50, args.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_scores, hf_experts = hf_model.model.layers[1].mlp.router(x)
        scores, experts, _ = ours.layers["1"].moe.router(x)
    assert torch.equal(experts, hf_experts)
    assert (scores - hf_scores).abs().max().item() <= 1e-6

    # Sensitivity: every gpt-oss feature moves the logits.
    with torch.no_grad():
        for block in ours.layers.values():
            block.attention.window.zero_()  # every layer full
        assert (ours(tokens) - want).abs().max() > 1e-2
        for block in ours.layers.values():
            block.attention.init_weights(0.02)  # windows back (and weights replaced): reload
        ours.load_state_dict(gpt_oss_hf.from_hf(hf_model.state_dict(), args))
        assert (ours(tokens) - want).abs().max().item() <= REL_TOL * scale
        sinks = [b.attention.sinks.weight.clone() for b in ours.layers.values()]
        for block in ours.layers.values():
            block.attention.sinks.weight.zero_()
        assert (ours(tokens) - want).abs().max() > 1e-2
        for block, s in zip(ours.layers.values(), sinks):
            block.attention.sinks.weight.copy_(s)
        if args.swiglu_limit < 1.0:  # the clamp bites only at a small limit (random weights, small activations)
            for block in ours.layers.values():
                block.moe.experts.limit = 1e9
            assert (ours(tokens) - want).abs().max() > 1e-2


def test_hf_state_dict_round_trip_is_exact():
    args = _args()
    hf_sd = _hf_model(args).state_dict()
    ours = gpt_oss_hf.from_hf(hf_sd, args)
    back = gpt_oss_hf.to_hf(ours, args)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    again = gpt_oss_hf.from_hf(back, args)
    assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours)
    # The experts are HF's tensors as they are; the sinks one box per head.
    gate_up = hf_sd["model.layers.0.mlp.experts.gate_up_proj"]
    assert ours["layers.0.moe.experts.gate_up_proj"].data_ptr() == gate_up.data_ptr()  # a view, no copy
    layout = gpt_oss_hf.hf_layout({k: tuple(v.shape) for k, v in hf_sd.items()}, args)
    assert len(layout["layers.1.attention.sinks.weight"].pieces) == args.n_heads
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.gate_up_proj_blocks: MXFP4"):
        gpt_oss_hf.from_hf({**hf_sd, "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match="layers.1.attention.sinks.weight: missing"):
        gpt_oss_hf.from_hf({k: v for k, v in hf_sd.items() if k != "model.layers.1.self_attn.sinks"}, args)
    assert models.get_model_family("gpt_oss").hf_adapter is gpt_oss_hf
    assert models.HF_MODEL_TYPES["gpt_oss"] == "gpt_oss"


# The published config.json of openai/gpt-oss-20b (transformers 4.55 form: rope_scaling + rope_theta).
HUB_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


def test_published_sizes_and_config_round_trip():
    assert gpt_oss_hf.args_from_hf_config(HUB_20B) == FLAVORS["20B"]
    hub_120b = {
        **HUB_20B,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    }
    assert gpt_oss_hf.args_from_hf_config(hub_120b) == FLAVORS["120B"]
    # transformers' GptOssConfig defaults are the 120B's.
    defaults = transformers.GptOssConfig().to_dict()
    assert gpt_oss_hf.args_from_hf_config(defaults) == FLAVORS["120B"]
    for name in ("debugmodel", "20B", "120B"):
        args = FLAVORS[name]
        assert gpt_oss_hf.args_from_hf_config(gpt_oss_hf.hf_config(args)) == args
    # Model cards: 21B / 3.6B active and 117B / 5.1B active (active without the embedding table).
    assert FLAVORS["20B"].num_params() == pytest.approx(20.91e9, rel=1e-3)
    assert FLAVORS["20B"].num_active_params(exclude_embedding=True) == pytest.approx(3.61e9, rel=1e-2)
    assert FLAVORS["120B"].num_params() == pytest.approx(116.83e9, rel=1e-3)
    assert FLAVORS["120B"].num_active_params(exclude_embedding=True) == pytest.approx(5.13e9, rel=1e-2)
    with torch.device("meta"):
        model = GptOssTransformer(FLAVORS["debugmodel"])
    assert sum(p.numel() for p in model.parameters()) == FLAVORS["debugmodel"].num_params()
    assert [b.attention.sliding_window for b in model.layers.values()] == [32, 0, 32, 0]
    with pytest.raises(ValueError, match="layer_types"):
        gpt_oss_hf.args_from_hf_config({**HUB_20B, "layer_types": ["full_attention"] * 24})
    with pytest.raises(ValueError, match="rope_parameters.truncate"):
        gpt_oss_hf.args_from_hf_config({**HUB_20B, "rope_scaling": {**HUB_20B["rope_scaling"], "truncate": True}})


def test_attn_backend_rule_refuses_kernels_without_sinks():
    backends = GptOssTransformer.attn_backends
    assert refusals(StepRequest(attn_backend="cpu_kernel", model_attn_backends=backends)) == [
        "model.attn_backend: cpu_kernel cannot serve this model's attention (attention sinks: the family's "
        "own torch formulation); allowed: auto, sdpa, splash"
    ]
    assert refusals(StepRequest(attn_backend="sdpa", model_attn_backends=backends)) == []
    assert refusals(StepRequest(attn_backend="cpu_kernel")) == []  # the other families
    # ... and the job's plan asks it: the recipe with the CPU kernel is refused before anything is built
    from models.errors import ConfigError
    from trainer.config import build_config
    from trainer.job import plan_job

    cfg = build_config("configs/gpt_oss_debug.toml", [("model.attn_backend", "cpu_kernel")])
    with pytest.raises(ConfigError, match=r"^model\.attn_backend: cpu_kernel cannot serve"):
        plan_job(cfg, world_size=1, device_type="cpu")
    plan_job(
        build_config("configs/gpt_oss_debug.toml", [("model.attn_backend", "sdpa")]), world_size=1, device_type="cpu"
    )


@pytest.mark.parametrize("degrees", [dict(dp_shard=2, ep=2), dict(dp_shard=1, tp=2, ep=2)], ids=["ep_fsdp", "ep_tp"])
def test_ep_and_tp_match_single_process(degrees):
    """Expert biases split with their experts over ep, the sinks split by heads over tp (colwise),
    q/k/v/o biases under TP: loss and every gradient equal one process on the global batch."""
    from tests.support.parallel_harness import SEQ_LEN, assert_matches_single_process, batch

    args = _args(vocab_size=256, sliding_window=4, max_seq_len=SEQ_LEN, num_experts_per_tok=2)
    inputs, labels = batch(args.vocab_size, 2)
    # biases and sinks nonzero, so that their sharding shows
    assert_matches_single_process(
        GptOssTransformer, args, PLAN, degrees, inputs, labels, perturb=("bias", "sinks.weight")
    )


def test_debug_recipe_trains_in_process(tmp_path, monkeypatch):
    """The debug recipe (window 16 < seq 64 here) trains a few fp32 steps through the trainer, the
    loss falls, and the planner's estimate reads the family through the contract."""
    from tests.support.trainer_runs import assert_recipe_learns

    overrides = {
        "model.n_layers": 2,
        "model.sliding_window": 16,
        "model.attn_backend": "sdpa",
        "training.seq_len": 64,
        "training.local_batch_size": 4,
    }
    assert_recipe_learns(monkeypatch, "configs/gpt_oss_debug.toml", tmp_path / "run", overrides)
