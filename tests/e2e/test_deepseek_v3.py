"""DeepSeek-V3 family: HF parity, HF round trips, published sizes, layer scan, router options.

Parity bound (fp32): our model and transformers' `DeepseekV3ForCausalLM` compute the same math in
different orders (our SDPA/op seam vs HF's eager attention with q pre-scaled by the softmax
scale, grouped expert matmuls vs HF's per-expert loop, the k routed outputs summed in another
order). fp32 has eps 1.2e-7; each matmul of K <= 512 terms moves a result by about sqrt(K) eps
~ 3e-6 relative, and 5 blocks plus the output projection compound a few of those. We bound the
max logit difference by 1e-5 x max |logit| (4x the largest measured, 2.5e-6: docs/models.md); a wrong layout, a
misplaced scale or a routing difference (a bias that also weights, no group limit) moves logits
by 1e-2 or more, which the sensitivity checks below confirm.
"""

import dataclasses

import pytest
import torch
import transformers  # the [dev] extra

import models
from models.common.moe import MoE
from models.deepseek_v3 import FLAVORS, DeepSeekV3
from models.deepseek_v3 import hf_adapter as ds_hf

REL_TOL = 1e-5


def _args(**kw):
    # max_seq_len = factor x original context, so transformers' YaRN sees a consistent config.
    return dataclasses.replace(FLAVORS["debugmodel"], **{"max_seq_len": 1024, **kw})


def _hf_model(args):
    config = transformers.DeepseekV3Config(**ds_hf.hf_config(args))
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights away from 1, so a misplaced norm shows
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a selection bias that changes the routing
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def _tokens(args, seqlen=24):
    return torch.randint(0, args.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kw", [{}, dict(q_lora_rank=0, num_shared_experts=2, v_head_dim=64)], ids=["lowrank_q", "full_q"]
)
def test_logits_match_transformers(kw):
    """First-k dense blocks, shared experts, sigmoid group-limited routing with a nonzero
    correction bias, routed scaling, YaRN (factor 4, mscale != mscale_all_dim)."""
    args = _args(rope_mscale_all_dim=0.707, **kw)
    hf_model = _hf_model(args)
    ours = DeepSeekV3(args).eval()
    ours.load_state_dict(ds_hf.from_hf(hf_model.state_dict(), args), strict=True)
    tokens = _tokens(args)
    with torch.no_grad():
        want = hf_model(tokens).logits
        got = ours(tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (got - want).abs().max().item()
    assert diff <= REL_TOL * scale, (diff, scale)

    # Sensitivity: the bias only selects, and the group limit changes the selection.
    router = ours.moe_layers["0"].moe.router
    with torch.no_grad():
        bias = router.expert_bias.clone()
        router.expert_bias.zero_()
        assert (ours(tokens) - want).abs().max() > 1e-2
        router.expert_bias.copy_(bias)
        router.top_groups = router.num_groups
        assert (ours(tokens) - want).abs().max() > 1e-2


def test_hf_round_trip_both_expert_layouts():
    args = _args()
    hf_sd = _hf_model(args).state_dict()
    ours = ds_hf.from_hf(hf_sd, args)
    fused = ds_hf.to_hf(ours, args, fused_experts=True)
    assert fused.keys() == hf_sd.keys()
    for key, value in hf_sd.items():
        assert torch.equal(fused[key], value), key
    hub = ds_hf.to_hf(ours, args)  # one tensor per expert, as checkpoints on the hub
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in hub
    again = ds_hf.from_hf(hub, args)
    assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours)
    # The box layout (per-rank loading, convert from-hf) builds the same tensors from both layouts.
    from models.common.hf_adapter import apply_layout

    for sd in (hf_sd, hub):
        laid = apply_layout(ds_hf.hf_layout({k: tuple(v.shape) for k, v in sd.items()}, args), sd)
        assert laid.keys() == ours.keys() and all(torch.equal(laid[k], ours[k]) for k in ours)
    # The multi-token-prediction layer of V3 checkpoints is skipped.
    extra = {**hub, f"model.layers.{args.n_layers}.eh_proj.weight": torch.zeros(2, 2)}
    assert ds_hf.from_hf(extra, args).keys() == ours.keys()


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_hf_config_round_trip(flavor):
    args = FLAVORS[flavor]
    assert ds_hf.args_from_hf_config(ds_hf.hf_config(args)) == args


def test_hf_config_rejects_variants():
    cfg = ds_hf.hf_config(FLAVORS["debugmodel"])
    with pytest.raises(ValueError, match="rope_interleave"):
        ds_hf.args_from_hf_config({**cfg, "rope_interleave": False})
    with pytest.raises(ValueError, match="model.score_func"):
        ds_hf.hf_config(dataclasses.replace(FLAVORS["debugmodel"], score_func="softmax"))


# Published sizes (billions): DeepSeek-V2-Lite card 15.7B total / 2.4B active; DeepSeek-V3 report
# 671B total / 37B active (the 14B multi-token-prediction module excluded); Kimi K2 report
# 1.04T total / 32B active. Our counts from the configs: 15.71 / 2.45 (active without the
# embedding table, as the V2-Lite card counts), 671.03 / 37.55, 1026.4 / 32.86: V3 within 0.5%,
# the rounded "37B" and K2's figures (whose exact basis the report does not give) within 3%.
PUBLISHED = [
    ("16B", "total", 15.7, 0.005),
    ("16B", "active_non_embedding", 2.4, 0.03),
    ("671B", "total", 671.0, 0.005),
    ("671B", "active", 37.0, 0.02),
    ("kimi_k2", "total", 1040.0, 0.02),
    ("kimi_k2", "active", 32.0, 0.03),
]


@pytest.mark.parametrize("flavor,what,published,rel", PUBLISHED)
def test_published_sizes(flavor, what, published, rel):
    args = FLAVORS[flavor]
    count = {
        "total": args.num_params(),
        "active": args.num_active_params(),
        "active_non_embedding": args.num_active_params(exclude_embedding=True),
    }[what] / 1e9
    assert abs(count - published) <= rel * published, (flavor, what, count)


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_flavor_builds_on_meta_and_formula_matches_module(flavor):
    family = models.get_model_family("deepseek_v3")
    with torch.device("meta"):
        model = family.model_cls(family.get_args(flavor))
    args = model.args
    assert list(model.dense_layers) == [str(i) for i in range(args.n_dense_layers)]
    assert len(model.moe_layers) == args.n_layers - args.n_dense_layers
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    unused = experts * (args.num_experts - args.num_experts_per_tok) // args.num_experts
    assert args.num_active_params() == args.num_params() - unused
    assert args.num_params(exclude_embedding=True) == args.num_params() - model.tok_embeddings.weight.numel()
    # The bias is state (DCP checkpoints it); the load counts are not.
    keys = model.state_dict().keys()
    assert "moe_layers.0.moe.router.expert_bias" in keys


def test_layer_scan_over_both_stacks_matches_unrolled():
    """Both stacks scanned (dense blocks as their own scan) give the unrolled loss, aux loss and
    gradients: the same fp32 ops per layer, so only the captured graph's op order differs (1e-6)."""
    torch.manual_seed(0)
    args = _args(n_layers=4, n_dense_layers=2, max_seq_len=64)
    loop = DeepSeekV3(args)
    loop.init_weights()
    scanned = DeepSeekV3(args)
    scanned.load_state_dict(loop.state_dict())
    tokens = _tokens(args, 16)

    def loss_fn(model):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        aux = model.pop_aux_loss()
        return loss + 0.1 * aux, aux

    want_loss, want_aux = loss_fn(loop)
    want_loss.backward()
    for stack in (scanned.dense_layers, scanned.moe_layers):
        stack.enable_scan()
    torch._dynamo.reset()
    got_loss, got_aux = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(scanned)
    stacks = {name: getattr(scanned, name).stacked_parameters() for name in ("dense_layers", "moe_layers")}
    flat = [(s, n, t) for s, d in stacks.items() for n, (t, _) in d.items()]
    grads = torch.autograd.grad(got_loss, [t for _, _, t in flat])
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_aux, want_aux, rtol=1e-6, atol=0)
    want = dict(loop.named_parameters())
    for (stack, name, t), grad in zip(flat, grads):
        ref = torch.stack([want[f"{stack}.{i}.{name}"].grad for i in range(t.shape[0])])
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item(), msg=f"{stack} {name}")


def test_expert_bias_update_and_counts():
    """The layer returns the token copies it routed per expert and `update_expert_bias` moves
    each bias by `rate` against the load (DeepSeek-V3's auxiliary-loss-free balancing)."""
    torch.manual_seed(0)
    moe = MoE(
        dim=16,
        hidden_dim=8,
        num_experts=4,
        top_k=2,
        norm_topk_prob=True,
        score_func="sigmoid",
        expert_bias=True,
        aux_loss="sequence",
    )
    moe.init_weights(0.02)
    router = moe.router
    x = torch.randn(2, 5, 16)
    _, _, load = moe(x)
    _, selected, _ = router(x.view(-1, 16))
    assert torch.equal(load, torch.bincount(selected.flatten(), minlength=4).float())
    assert not load.requires_grad and load.sum().item() == 2 * 5 * 2
    router.update_expert_bias(load, rate=0.001)
    mean = load.mean()
    want = torch.where(load > mean, -0.001, torch.where(load < mean, 0.001, 0.0))
    torch.testing.assert_close(router.expert_bias, want)


def test_sequence_aux_loss_is_one_when_balanced():
    """DeepSeek-V3's sequence-wise loss is 1 for uniform scores and perfectly spread selections."""
    from models.common.moe import sequence_balance_loss

    scores = torch.full((2, 4, 4), 0.3)
    selected = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).expand(2, 4, 2)
    assert sequence_balance_loss(scores, selected, 4).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1]] * 4).expand(2, 4, 2)
    peaked = torch.tensor([0.9, 0.9, 0.1, 0.1]).expand(2, 4, 4)
    assert sequence_balance_loss(peaked, skewed, 4).item() > 1.5  # 2 x 0.9 / 1.0 x 2 = 1.8


def test_sequence_aux_loss_over_sequence_shards_is_the_whole_sequences():
    """Two equal shards of every sequence (what context parallelism or TP's sequence shards give
    two ranks), each with `reduce_counts` summing the shards' counts: the mean of the two shard
    losses, and its gradient, equal the loss on the whole sequences (to fp32 rounding of a sum of
    ~100 terms, 1e-6). Without the reduction the shard losses differ from it."""
    from models.common.moe import sequence_balance_loss

    g = torch.Generator().manual_seed(0)
    E, k = 8, 2
    scores = torch.rand(3, 12, E, generator=g).requires_grad_()
    # Skewed selections, different in the two halves, so per-shard fractions differ from the whole.
    selected = torch.stack([torch.randperm(E, generator=g)[:k] % (3 + i // 6) for i in range(3 * 12)])
    selected = selected.view(3, 12, k)
    whole = sequence_balance_loss(scores, selected, E)
    (want,) = torch.autograd.grad(whole, scores)

    halves = [(scores[:, :6], selected[:, :6]), (scores[:, 6:], selected[:, 6:])]

    def counts(sel):
        c = torch.zeros(3, E).scatter_add_(1, sel.reshape(3, -1), torch.ones(3, 6 * k))
        return torch.cat([c.reshape(-1), torch.tensor([6.0])])

    totals = counts(halves[0][1]) + counts(halves[1][1])
    shards = [sequence_balance_loss(sc, sel, E, reduce_counts=lambda t: totals) for sc, sel in halves]
    mean = (shards[0] + shards[1]) / 2
    (got,) = torch.autograd.grad(mean, scores)
    torch.testing.assert_close(mean, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    per_shard = sum(sequence_balance_loss(sc, sel, E) for sc, sel in halves) / 2
    assert abs(per_shard.item() - whole.item()) > 1e-3


# --- training under the parallelisms (trainer.train, as users launch it) -------------------------
# fp32, seq 64, global batch 4, 6 steps. Bound on the losses against the 1-process eager run: 1e-5
# relative (as tests/e2e/test_new_family.py argues): another mesh or a captured graph only changes the
# summation order (~1e-7 relative per step); a wrong shard or a missing gradient sum (e.g. MLA's
# shared RoPE key without its TP sum) moves a loss by 1e-3 or more. The runs use the recipe's
# sequence-wise balance loss, whole-sequence under TP's sequence shards (models/common/moe.py; per
# shard it moved the tp=2 losses by 3.6e-5); the global-batch loss: tests/unit/test_expert_parallel.py.

from tests.support.trainer_runs import assert_losses_close, train  # noqa: E402

STEPS = 6
COMMON = [
    "--config",
    "configs/deepseek_v3_debug.toml",
    f"--training.steps={STEPS}",
    "--training.seq_len=64",
    "--metrics.log_freq=1",
    "--checkpoint.enable=false",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=2",
]


def _curves(folder, nproc: int, degrees: dict, *extra: str) -> tuple[list[float], list[float]]:
    """The logged losses and global gradient norms (before clipping) of steps 1..STEPS."""
    records = train(folder, nproc, degrees, *COMMON, *extra)
    assert sorted(records) == list(range(1, STEPS + 1))
    return ([records[s]["loss"] for s in range(1, STEPS + 1)], [records[s]["grad_norm"] for s in range(1, STEPS + 1)])


@pytest.fixture(scope="module")
def eager_curves(tmp_path_factory):
    losses, norms = _curves(tmp_path_factory.mktemp("eager"), 1, {})
    assert losses[-1] < losses[0]
    return losses, norms


def _assert_curves_close(got, want):
    """Losses of every step within 1e-5 relative; the global gradient norms of steps 1-2 (the
    warmup, at lr <= 1.5e-3) within 1e-5 too: the same fp32 gradients summed in another order
    (~1e-6; measured up to 1.9e-6). Later norms are not compared: at the full lr (3e-3) AdamW turns
    summation-order noise in near-zero gradient entries into full-size updates, and the norms
    of both meshes drift apart by up to 8e-5 relative by step 6 while the losses still agree to
    3e-7; the same drift shows for Llama 3 on dp_shard 2 (measured), so it is the optimizer's,
    not this family's."""
    assert_losses_close(got[0], want[0])
    assert_losses_close(got[1][:2], want[1][:2])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "degrees",
    [
        pytest.param(dict(dp_shard=2), id="fsdp2", marks=pytest.mark.exhaustive),  # SimpleFSDP is family-generic
        pytest.param(dict(tp=2), id="tp2"),
        pytest.param(dict(dp_shard=2, ep=2), id="ep2", marks=pytest.mark.slow),
        # Context parallelism is family-generic (tests/e2e/test_cp_train.py); this point adds the
        # sequence-wise loss over the cp ranks' chunks.
        pytest.param(dict(cp=2), id="cp2", marks=pytest.mark.exhaustive),
    ],
)
def test_parallel_matches_single_process(tmp_path, eager_curves, degrees):
    """SimpleFSDP over 2 ranks; TP over 2 ranks with the MLA plan (models/deepseek_v3/plan.py); EP over
    2 ranks (experts split, shared experts and router data-parallel); context parallelism over 2
    ranks. Losses and gradient norms per step; the selection biases' trajectory:
    tests/e2e/test_expert_balance.py."""
    extra = [f"--parallelism.context_parallel_degree={degrees['cp']}"] if "cp" in degrees else []
    _assert_curves_close(_curves(tmp_path, 2, degrees, *extra), eager_curves)


@pytest.mark.slow
def test_graph_mode_scan_matches_eager(tmp_path, eager_curves):
    """Graph mode with layer scan over both stacks (dense blocks scanned as their own stack)."""
    _assert_curves_close(
        _curves(tmp_path, 1, {}, "--compile.mode=graph", "--compile.backend=aot_eager", "--compile.scan_layers=true"),
        eager_curves,
    )


def test_qwen3_moe_expert_bias_is_opt_in():
    """Qwen 3 MoE gets the selection bias only with `moe_expert_bias`; its default state dict and
    numbers are unchanged, and the HF adapters fill/drop the (zero) bias."""
    from models.qwen3 import hf_adapter as qwen3_hf

    family = models.get_model_family("qwen3")
    plain = family.model_cls(family.get_args("debugmodel_moe", n_layers=2, max_seq_len=64))
    biased_args = family.get_args("debugmodel_moe", n_layers=2, max_seq_len=64, moe_expert_bias=True)
    biased = family.model_cls(biased_args)
    assert not any("expert_bias" in k for k in plain.state_dict())
    missing, unexpected = biased.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["layers.0.moe.router.expert_bias", "layers.1.moe.router.expert_bias"] and not unexpected
    with torch.no_grad():
        for block in biased.layers.values():
            block.moe.router.expert_bias.zero_()
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(tokens), biased(tokens))  # a zero bias selects as no bias
        biased.layers["0"].moe.router.expert_bias[0] = 10.0  # expert 0 always selected
        assert not torch.equal(plain(tokens), biased(tokens))
    hf_sd = qwen3_hf.to_hf(plain.state_dict(), biased_args)
    biased.load_state_dict(qwen3_hf.from_hf(hf_sd, biased_args), strict=True)
    assert not biased.layers["0"].moe.router.expert_bias.any()
    with torch.no_grad():
        biased.layers["0"].moe.router.expert_bias[0] = 10.0
    with pytest.raises(ValueError, match="expert_bias"):
        qwen3_hf.to_hf(biased.state_dict(), biased_args)


def test_convert_hf_folder_to_dcp_and_back(tmp_path):
    """`scripts/convert.py from-hf` (through `hf_layout`) then `to-hf`: the HF safetensors come back
    bit for bit (selection bias included) and load with `from_pretrained`."""
    import glob
    import subprocess
    import sys

    from safetensors.torch import load_file

    args = _args()
    _hf_model(args).save_pretrained(tmp_path / "hf")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    for cmd in (
        ["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")],
        [
            "to-hf",
            "--checkpoint",
            str(tmp_path / "dcp"),
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",
            "--model.max_seq_len=1024",
            str(tmp_path / "hf2"),
        ],
    ):
        r = subprocess.run(
            [sys.executable, "scripts/convert.py", *cmd],
            cwd=root,
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]

    def tensors(folder):
        out = {}
        for f in glob.glob(str(folder / "*.safetensors")):
            out.update(load_file(f))
        return out

    want, got = tensors(tmp_path / "hf"), tensors(tmp_path / "hf2")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").config.model_type == "deepseek_v3"


def test_document_mask_equals_separate_documents():
    """A row packing two documents (segment ids, positions restarting at 0) gives each document's
    logits as if it ran alone: attention stays inside a segment and RoPE restarts. MoE routing
    is per token, so nothing else couples the documents; same fp32 ops, other shapes: 1e-5."""
    from models.common.rope import document_positions

    torch.manual_seed(0)
    args = _args(n_layers=3, n_dense_layers=1, max_seq_len=64)
    model = DeepSeekV3(args)
    model.init_weights()
    a, b = _tokens(args, 10)[0:1], _tokens(args, 14)[1:2]
    packed = torch.cat([a, b], dim=1)
    segment_ids = torch.tensor([[0] * 10 + [1] * 14])
    with torch.no_grad():
        got = model(packed, segment_ids, document_positions(segment_ids))
        want = torch.cat([model(a), model(b)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flavor", ["debugmodel", "671B", "kimi_k2"])
def test_attention_op_receives_unpadded_v(flavor):
    """MLA hands the attention op q/k at `qk_head_dim` and v at `v_head_dim` (DeepSeek-V3 /
    Kimi K2: 192 and 128), no zero-padded columns, and gets the output back at v's width: splash
    takes both widths, so the +50 % PV product and V residuals of padding are not paid (the SDPA
    reference pads inside, for ATen's one-width kernels; tests/unit/test_attention_widths.py). The
    full-size flavors run one MLA layer on the meta device (shapes only)."""
    from models.common import ops
    from models.deepseek_v3.model import MLA

    args = FLAVORS[flavor]
    seen = []

    def recording(q, k, v, segment_ids=None):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return ops.sdpa_causal_attention(q, k, v, segment_ids)

    device = "cpu" if flavor == "debugmodel" else "meta"
    seq = 8
    with torch.device(device):
        mla = MLA(args)
        x = torch.randn(1, seq, args.dim)
        cos, sin = torch.randn(seq, args.qk_rope_head_dim), torch.randn(seq, args.qk_rope_head_dim)
    if device == "cpu":
        mla.init_weights(0.02)
    previous = ops.register("causal_attention", recording)
    try:
        out = mla(x, cos, sin)
    finally:
        ops.register("causal_attention", previous)
    ((q_shape, k_shape, v_shape),) = seen
    h = args.n_heads
    assert q_shape == k_shape == (1, h, seq, args.qk_head_dim)
    assert v_shape == (1, h, seq, args.v_head_dim)
    assert out.shape == (1, seq, args.dim)
    if flavor != "debugmodel":
        assert (args.qk_head_dim, args.v_head_dim) == (192, 128)
