"""DeepSeek-V4 family: HF logits parity, the indexer's selection, HF round trips, published sizes,
FSDP / EP against one process, the refusals, and the debug recipe training in-process.

Parity bound (fp32): ours and transformers' `DeepseekV4ForCausalLM` (eager attention, eager
experts) compute the same math in different orders: grouped expert matmuls vs HF's per-expert
loop, the k routed outputs summed in choice order vs HF's expert order, attention through SDPA with
the sink as one more key vs HF's explicit softmax over [logits | sink], RoPE on pairs vs HF's
repeat-interleaved tables. fp32 eps is 1.2e-7; a matmul of K <= 128 terms moves a result by about
sqrt(K) eps ~ 1.4e-6 relative, the 20 Sinkhorn iterations and 4 blocks of two hyper-connected
sub-layers compound a few of those. We bound the max logit difference by 1e-5 x max |logit| (the
gpt-oss and DeepSeek-V3 tests' bound; measured about 8e-7, docs/models.md), while a sink, a
window, the indexer's top-k, the hash table or the Sinkhorn projection left out moves logits by
1e-2 or more (the sensitivity checks below). The sequence (96 tokens) is 6 windows of 16, 24 CSA
entries of which a query keeps 4, 6 HCA entries: every path is taken.
"""

import dataclasses

import pytest
import torch
import transformers  # the [dev] extra

import models
from models.deepseek_v4 import FLAVORS, DeepSeekV4
from models.deepseek_v4 import hf_adapter as v4_hf
from models.deepseek_v4.plan import PLAN
from models.errors import ConfigError

REL_TOL = 1e-5
SEQ = 96


def _args(**kw):
    # The debug flavor's shape (blocks HCA+hash, CSA+hash, sliding, CSA) at width 64, YaRN on the
    # compressed blocks (factor 4 over 32 tokens: a ramp inside the rotary dims), a clamp that bites.
    base = dict(dim=64, vocab_size=160, max_seq_len=128, rope_factor=4.0, rope_original_max_seq_len=32)
    return dataclasses.replace(FLAVORS["debugmodel"], **{**base, "swiglu_limit": 0.5, **kw})


def _hf_model(args):
    config = transformers.DeepseekV4Config(**v4_hf.hf_config(args))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1, so a misplaced norm shows
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 1 or name.endswith(("position_bias", "base", "scale")):  # sinks, biases: nonzero
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # HF starts it at zeros: k distinct random experts per token
                draws = [torch.randperm(args.num_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(draws))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def _ours(args, hf_model):
    model = DeepSeekV4(args).eval()
    model.init_weights()
    model.load_state_dict(v4_hf.from_hf(hf_model.state_dict(), args), strict=True)
    return model


def _tokens(args, seqlen=SEQ):
    return torch.randint(0, args.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))


def test_logits_match_transformers():
    args = _args()
    assert args.layer_kinds() == "hcsc" and args.num_hash_layers == 2
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

    # Sensitivity: each part moves the logits (then the weights are reloaded).
    def moved(change) -> float:
        with torch.no_grad():
            change()
            out = (ours(tokens) - want).abs().max().item()
        ours.load_state_dict(v4_hf.from_hf(hf_model.state_dict(), args))
        return out

    blocks = list(ours.layers.values())
    assert moved(lambda: [b.attention.sinks.zero_() for b in blocks]) > 1e-2
    assert moved(lambda: blocks[0].moe.router.tid2eid.copy_(blocks[0].moe.router.tid2eid.roll(1, 0))) > 1e-2
    for block in blocks:
        block.attention.window = 1000  # full causal instead of the window
    assert moved(lambda: None) > 1e-2
    for block in blocks:
        block.attention.window = args.sliding_window
    blocks[3].attention.indexer.topk = 1000  # every closed entry instead of the top 4
    assert moved(lambda: None) > 1e-2
    blocks[3].attention.indexer.topk = args.index_topk
    for block in blocks:  # no Sinkhorn iterations past the first normalisation
        block.attn_hc.iters = block.ffn_hc.iters = 1
    assert moved(lambda: None) > 1e-2
    for block in blocks:
        block.attn_hc.iters = block.ffn_hc.iters = args.hc_sinkhorn_iters
    for block in blocks:
        block.moe.experts.limit = block.moe.shared_experts.limit = 1e9
    assert moved(lambda: None) > 1e-2


def test_indexer_selects_what_transformers_selects():
    """The CSA block's lightning indexer keeps the same 4 of up to 24 closed entries per query."""
    args = _args()
    hf_model = _hf_model(args)
    ours = _ours(args, hf_model)
    x = torch.randn(2, SEQ, args.dim, generator=torch.Generator().manual_seed(3))
    hf_attn, attn = hf_model.model.layers[1].self_attn, ours.layers["1"].attention
    positions = torch.arange(SEQ).unsqueeze(0)
    with torch.no_grad():
        q_lora = attn.q_norm(attn.wq_a(x))
        hf_idx = hf_attn.compressor.indexer(x, q_lora, positions, None, 1)  # [b, s, k], -1: none
        want = torch.zeros(2, SEQ, SEQ // args.csa_ratio + 1, dtype=torch.bool)
        want.scatter_(-1, torch.where(hf_idx < 0, SEQ // args.csa_ratio, hf_idx), True)
        i, w = torch.arange(SEQ), torch.arange(SEQ // args.csa_ratio)
        closed = w[None, :] < ((i + 1) // args.csa_ratio)[:, None]
        cos, sin = ours.compress_rope_cos[:SEQ], ours.compress_rope_sin[:SEQ]
        got = attn.indexer.select(x, q_lora, closed, cos, sin)
    assert torch.equal(got, want[..., :-1])
    assert got.sum(-1).max() == args.index_topk and closed.sum(-1).max() == SEQ // args.csa_ratio  # sparse


def test_hf_state_dict_round_trip_is_exact():
    args = _args()
    hf_sd = _hf_model(args).state_dict()
    ours = v4_hf.from_hf(hf_sd, args)
    back = v4_hf.to_hf(ours, args)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    again = v4_hf.from_hf(back, args)
    assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours)
    assert set(ours) == set(DeepSeekV4(args).state_dict())
    # Renames are views; the fused experts two boxes of one tensor.
    q = hf_sd["model.layers.0.self_attn.q_a_proj.weight"]
    assert ours["layers.0.attention.wq_a.weight"].data_ptr() == q.data_ptr()
    layout = v4_hf.hf_layout({k: tuple(v.shape) for k, v in hf_sd.items()}, args)
    assert {p.hf_key for p in layout["layers.2.moe.experts.w3"].pieces} == {"model.layers.2.mlp.experts.gate_up_proj"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_c_proj\.weight: unknown"):
        v4_hf.from_hf({**hf_sd, "model.layers.0.self_attn.q_c_proj.weight": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.indexer\.wq_b\.weight: missing"):
        v4_hf.from_hf({k: v for k, v in hf_sd.items() if "indexer.q_b_proj" not in k}, args)
    with pytest.raises(ValueError, match=r"layers\.2\.moe\.router\.tid2eid: not a tensor of this flavor"):
        v4_hf.from_hf({**hf_sd, "model.layers.2.mlp.gate.tid2eid": hf_sd["model.layers.0.mlp.gate.tid2eid"]}, args)
    # MTP weights of a release are not ours (as transformers skips them).
    assert v4_hf.from_hf({**hf_sd, "mtp.0.norm.weight": torch.ones(1)}, args).keys() == ours.keys()
    assert models.get_model_family("deepseek_v4").hf_adapter is v4_hf
    assert models.HF_MODEL_TYPES["deepseek_v4"] == "deepseek_v4"


def test_published_sizes_and_config_round_trip():
    # The flash flavor is transformers' defaults (DeepSeek-V4-Flash-Base's shape).
    assert v4_hf.args_from_hf_config(transformers.DeepseekV4Config().to_dict()) == FLAVORS["flash"]
    for name in ("debugmodel", "flash"):
        args = FLAVORS[name]
        assert v4_hf.args_from_hf_config(v4_hf.hf_config(args)) == args
        assert v4_hf.args_from_hf_config(transformers.DeepseekV4Config(**v4_hf.hf_config(args)).to_dict()) == args
    yarn = _args()
    assert v4_hf.args_from_hf_config(transformers.DeepseekV4Config(**v4_hf.hf_config(yarn)).to_dict()) == yarn
    # Legacy keys transformers folds in: per-layer compress ratios, num_hash_layers, qk_rope_head_dim.
    legacy = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "compress_ratios": [128, 4, 0, 4]}
    legacy_args = v4_hf.args_from_hf_config({**legacy, "num_hash_layers": 2, "qk_rope_head_dim": 64})
    assert legacy_args.layer_kinds() == "hcsc" and legacy_args.num_hash_layers == 2
    # Model card: 284B parameters, 13B activated.
    assert FLAVORS["flash"].num_params() == pytest.approx(284.3e9, rel=1e-3)
    assert FLAVORS["flash"].num_active_params(exclude_embedding=True) == pytest.approx(13.26e9, rel=1e-3)
    for name in ("debugmodel", "flash"):
        with torch.device("meta"):
            model = DeepSeekV4(FLAVORS[name])
        assert sum(p.numel() for p in model.parameters()) == FLAVORS[name].num_params()
    with pytest.raises(ValueError, match="mlp_layer_types"):
        v4_hf.args_from_hf_config({**legacy, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]})
    with pytest.raises(ValueError, match="scoring_func"):
        v4_hf.args_from_hf_config({**legacy, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="attention_layers"):
        dataclasses.replace(FLAVORS["debugmodel"], attention_layers="hcx")


def test_mixing_flops_count_the_keys_a_query_sees():
    args = FLAVORS["debugmodel"]  # window 16, CSA 4 tokens / top 4, HCA 16
    t = 4096
    flops = args.mixing_flops_per_token(t)
    # Per block, mean keys of a causal row: the window's ~16, + ~t/32 HCA entries, + ~4 CSA entries.
    keys = {"h": 16 - 128 / t + t / 32, "c": 16 - 128 / t + 4 - 8 / (t / 4), "s": 16 - 128 / t}
    per_head = sum(keys[k] for k in args.layer_kinds())
    indexer = 2 * 2.0 * args.index_n_heads * args.index_head_dim * (t / 8)  # two CSA blocks, forward only
    with torch.device("meta"):
        model = DeepSeekV4(args)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the indexers: 2x, not 6x
    assert frozen == 2 * sum(p.numel() for p in model.layers["1"].attention.indexer.parameters())
    attention = 12 * args.n_heads * args.head_dim * per_head + indexer
    assert flops["causal"] == pytest.approx(attention - 4 * frozen)
    assert flops["palm"] == pytest.approx(2 * attention - 4 * frozen)


def test_refusals_tp_cp_kernels_and_layer_scan():
    from trainer.config import build_config
    from trainer.graph.step import _enable_scans
    from trainer.job import plan_job

    def refusal(overrides, world_size=2):
        cfg = build_config("configs/deepseek_v4_debug.toml", overrides)
        with pytest.raises(ConfigError) as e:
            plan_job(cfg, world_size=world_size, device_type="cpu")
        return str(e.value)

    assert refusal([("parallelism.tensor_parallel_degree", "2")]).startswith(
        "parallelism.tensor_parallel_degree: DeepSeek-V4 has no tensor-parallel plan yet"
    )
    assert refusal([("parallelism.context_parallel_degree", "2")]).startswith(
        "parallelism.context_parallel_degree: 2 needs a model that takes RoPE positions"
    )
    assert refusal([("model.attn_backend", "cpu_kernel")], 1).startswith(
        "model.attn_backend: cpu_kernel cannot serve this model's attention"
    )
    ep = build_config("configs/deepseek_v4_debug.toml", [("parallelism.expert_parallel_degree", "2")])
    plan_job(ep, world_size=2, device_type="cpu")  # EP is not refused: hash routing chooses before dispatch
    model = DeepSeekV4(FLAVORS["debugmodel"])
    with pytest.raises(ConfigError, match=r"^compile\.scan_layers: the model's `layers` cannot be scanned \(block 1"):
        _enable_scans(model, PLAN)


@pytest.mark.parametrize("degrees", [dict(dp_shard=2), dict(dp_shard=2, ep=2)], ids=["fsdp", "ep_fsdp"])
def test_fsdp_and_ep_match_single_process(degrees):
    """Hash and learned routing, the selection bias, the compressors and the hyper-connections under
    FSDP (and experts split over ep): loss and every gradient equal one process on the global batch
    (the indexer has none: its top-k is not differentiable, as in the reference)."""
    from tests.support.parallel_harness import assert_matches_single_process

    # 48 tokens: past the window (16), 12 CSA entries of which a query keeps 4, 3 HCA entries.
    args = dataclasses.replace(FLAVORS["debugmodel"], dim=64, vocab_size=256, max_seq_len=48)
    gen = torch.Generator().manual_seed(1)
    inputs, labels = (torch.randint(0, args.vocab_size, (2, 48), generator=gen) for _ in range(2))
    assert_matches_single_process(
        DeepSeekV4,
        args,
        PLAN,
        degrees,
        inputs,
        labels,
        perturb=("sinks", "position_bias", "base"),  # nonzero, so that their sharding shows
        without_grad=lambda name: ".indexer." in name,
    )


def test_debug_recipe_trains_in_process(tmp_path, monkeypatch):
    """The debug recipe (every block kind at 128 tokens: window 16, CSA top 4 of up to 32 entries,
    8 HCA entries) trains a few fp32 steps through the trainer and the loss falls."""
    from tests.support.trainer_runs import assert_recipe_learns

    overrides = {"training.seq_len": 128, "training.local_batch_size": 4}
    assert_recipe_learns(monkeypatch, "configs/deepseek_v4_debug.toml", tmp_path / "run", overrides)
