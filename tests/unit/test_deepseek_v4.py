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
    assert moved(lambda: [b.attention.sinks.weight.zero_() for b in blocks]) > 1e-2
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
        got = attn.indexer(x, q_lora, closed, cos, sin)
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

    # TP splits the query heads and the output groups (debugmodel: 4 heads in 2 groups); the one KV
    # head is replicated, so it sets no bound.
    tp2 = build_config("configs/deepseek_v4_debug.toml", [("parallelism.tensor_parallel_degree", "2")])
    plan_job(tp2, world_size=2, device_type="cpu")
    assert refusal([("parallelism.tensor_parallel_degree", "4")], 4) == (
        "parallelism.tensor_parallel_degree: 4 does not divide the model's o_groups (2); allowed: divisors of 2"
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
        perturb=("sinks.weight", "position_bias", "base"),  # nonzero, so that their sharding shows
        without_grad=lambda name: ".indexer." in name,
    )


def test_tp_styles_split_streams_groups_sinks_and_token_ids():
    """The TP styles the plan adds, each on a tiny module over 2 thread ranks against one process:
    a hyper-connection on the rank's half of the sequence ("sequence_local": its three outputs, and
    its weights' gradients summed over the ranks), `wo_a` split by group then `wo_b` rowwise
    ("grouped_colwise": rank r feeds its group r and gets its half of the sequence back), the sinks
    by head ("head_sharded") and the token ids by sequence half ("sequence_shard"). Each rank's
    loss is its own share of the one-process loss, so every gradient equals the whole one's."""
    import copy

    from torch.distributed.tensor.parallel import parallelize_module

    from models.deepseek_v4.model import GroupedLinear, HyperConnection, Sinks, TokenIds
    from parallelisms import ParallelDims, build_mesh
    from parallelisms.tensor_parallel import style_for
    from tests.support.parallel_harness import full, rel_diff, run_threads

    torch.manual_seed(0)
    hc = HyperConnection(dim=8, n=2, iters=3, eps=1e-6, norm_eps=1e-6)
    wo_a, wo_b, sinks = GroupedLinear(6, 4, 2), torch.nn.Linear(8, 8, bias=False), Sinks(4)
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale, wo_a.weight, sinks.weight):
            p.copy_(torch.randn(p.shape))
    h, g = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 6)  # streams [b, s, n, D]; groups [b, s, G, in]
    w = [torch.randn(1, 4, 2), torch.randn(1, 4, 2, 2), torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.randn(4)]
    tokens = torch.arange(8).view(1, 8)

    def loss_of(hc, wo_a, wo_b, sinks, h, g, w):
        post, comb, x = hc(h)
        out = wo_b(wo_a(g).flatten(2))
        terms = (post * w[0], comb * w[1], x * w[2], out * w[3], sinks() * w[4])
        return sum(t.sum() for t in terms), out

    modules = (hc, wo_a, wo_b, sinks)
    loss, out_ref = loss_of(*modules, h, g, w)
    loss.backward()
    want = {f"{i}.{n}": p.grad for i, m in enumerate(modules) for n, p in m.named_parameters()}

    def rank_fn():
        tp = build_mesh(ParallelDims(world_size=2, dp_shard=1, tp=2), "cpu")["tp"]
        r = tp.get_local_rank()
        ours = copy.deepcopy(modules)
        for module, style in zip(
            (*ours, ids := TokenIds()),
            ("sequence_local", "grouped_colwise", "rowwise", "head_sharded", "sequence_shard"),
        ):
            parallelize_module(module, tp, style_for(style))
        half = slice(2 * r, 2 * r + 2)
        w_local = [w[0][:, half], w[1][:, half], w[2][:, half], w[3][:, half], w[4][half]]
        loss, out = loss_of(*ours, h[:, half], g[:, :, r : r + 1], w_local)
        loss.backward()
        grads = {f"{i}.{n}": full(p.grad) for i, m in enumerate(ours) for n, p in m.named_parameters()}
        return out, ids(tokens), grads, r

    for out, token_ids, grads, r in run_threads(2, rank_fn):
        assert rel_diff(out, out_ref[:, 2 * r : 2 * r + 2]) < 1e-6
        assert torch.equal(token_ids, tokens[:, 4 * r : 4 * r + 4])
        assert set(grads) == set(want)
        for name, grad in want.items():
            assert rel_diff(grads[name], grad) < 1e-5, name


def _hyper_connection_tolerance(name: str) -> float:
    """Relative gradient bound of the TP tests. 1e-5, but 1e-4 for the hyper-connections' weights
    (`attn_hc`, `ffn_hc`, `hc_head`: fn, base, scale): their gradients are sums over every token
    and stream of terms that largely cancel (a `scale` multiplies all the token's mixing logits),
    and TP sums them in two sequence halves. The one-process fp32 reference itself is up to 2.8e-5
    away from the same model in float64 there (measured: layers.0.attn_hc.scale 2.8e-5, hc_head.fn
    2.5e-5; every other gradient within 1e-5), and TP measured 3.0e-5. `hc_head.scale`, one scalar
    over all of it, 5e-4: with the window-blocked attention (a different summation order, exact in
    float64) the one-process fp32 gradient is 8.2e-5 from float64 and TP 2 x FSDP 2's 1.6e-4 (so
    2.4e-4 apart), while every gradient but the hyper-connections' stays within 1.2e-6 of float64
    (measured by hand, 2026-12-07). A missing TP sum is a factor near 2; a missing head sum (the
    shared KV) moved the KV path's gradients by 0.97."""
    if name == "hc_head.scale":
        return 5e-4
    return 1e-4 if "_hc." in name or name.startswith("hc_head.") else 1e-5


@pytest.mark.parametrize(
    "degrees,world",
    [(dict(dp_shard=1, tp=2), 2), (dict(dp_shard=2, tp=2), 4)],
    ids=["tp", "tp_fsdp"],
)
def test_tp_matches_single_process(degrees, world):
    """TP 2 (and TP 2 x FSDP 2): the query heads, the sinks and the output groups split by head, the
    shared KV head, compressors and indexer replicated, the hyper-connections and the MoE on the
    rank's sequence shard (hash blocks reading their own tokens' ids): loss within 1e-6 and every
    gradient within `_hyper_connection_tolerance` of one process. Sinks, position biases and
    hyper-connection biases are nonzero, so a wrong split of any shows."""
    from tests.support.parallel_harness import assert_matches_single_process

    # 32 tokens: past the window (16), 8 CSA entries of which a query keeps 4, 2 HCA entries; the
    # two sequence halves of 16 each hold CSA and HCA windows.
    args = dataclasses.replace(FLAVORS["debugmodel"], dim=64, vocab_size=256, max_seq_len=32, hc_sinkhorn_iters=3)
    gen = torch.Generator().manual_seed(1)
    inputs, labels = (torch.randint(0, args.vocab_size, (2, 32), generator=gen) for _ in range(2))
    assert_matches_single_process(
        DeepSeekV4,
        args,
        PLAN,
        degrees,
        inputs,
        labels,
        perturb=("sinks.weight", "position_bias", "base"),
        tolerance=_hyper_connection_tolerance,
        without_grad=lambda name: ".indexer." in name,
        world_size=world,
    )


def test_debug_recipe_trains_in_process(tmp_path, monkeypatch):
    """The debug recipe (every block kind at 128 tokens: window 16, CSA top 4 of up to 32 entries,
    8 HCA entries) trains a few fp32 steps through the trainer and the loss falls."""
    from tests.support.trainer_runs import assert_recipe_learns

    overrides = {"training.seq_len": 128, "training.local_batch_size": 4}
    assert_recipe_learns(monkeypatch, "configs/deepseek_v4_debug.toml", tmp_path / "run", overrides)
