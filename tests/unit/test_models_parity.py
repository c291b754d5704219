"""Hugging Face parity: the same random weights give the same logits as transformers (fp32).

Each case builds a tiny HF config from our `hf_config(args)` (so the config writer is tested
too), randomises every HF parameter (norm weights included, so q/k-norm mix-ups show), converts
the HF state dict with `from_hf`, loads it strictly into our model and compares logits. The
round trip `to_hf(from_hf(sd))` must give back the HF tensors.
"""

import pytest
import torch
import transformers  # the [dev] extra; scripts/test.sh installs it, so HF checks never vanish as skips

from models.common.moe import load_balance_loss  # noqa: E402
from models.llama3 import hf_adapter as llama3_hf  # noqa: E402
from models.llama3.args import Llama3Args  # noqa: E402
from models.llama3.model import Transformer as Llama3  # noqa: E402
from models.qwen3 import hf_adapter as qwen3_hf  # noqa: E402
from models.qwen3.args import Qwen3Args  # noqa: E402
from models.qwen3.model import Transformer as Qwen3  # noqa: E402

TOL = 1e-5


def _hf_model(config_dict: dict):
    cls_name = config_dict["architectures"][0]
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    }[cls_name]
    config = config_cls(**config_dict)
    config._attn_implementation = "eager"
    model = getattr(transformers, cls_name)(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights: away from 1 so a missing/misplaced norm is visible
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _check(args, hf_module, model_cls, seqlen: int = 24):
    hf_model = _hf_model(hf_module.hf_config(args))
    hf_sd = hf_model.state_dict()
    ours = model_cls(args).eval()
    ours.load_state_dict(hf_module.from_hf(hf_sd, args), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero tensors
    assert (got - expected).abs().max().item() <= TOL
    return hf_model, ours, tokens


def _llama(**kw) -> Llama3Args:
    base = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=160, multiple_of=32, max_seq_len=64)
    return Llama3Args(**{**base, **kw})


def _qwen(**kw) -> Qwen3Args:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, hidden_dim=96, max_seq_len=64)
    return Qwen3Args(**{**base, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=8),  # MHA (GQA ratio 1)
        dict(n_kv_heads=4, tie_embeddings=True),  # ratio 2, tied
        # ratio 4 with Llama 3.1 scaling; a short original context puts the scaled band in range.
        dict(n_kv_heads=2, rope_scaling_factor=8.0, rope_original_max_seq_len=16),
        dict(n_kv_heads=2, rope_scaling_factor=32.0, rope_original_max_seq_len=32, tie_embeddings=True),
    ],
)
def test_llama3_matches_hf(kw):
    args = _llama(**kw)
    hf_model, _, _ = _check(args, llama3_hf, Llama3)
    _check_round_trip(hf_model.state_dict(), args, llama3_hf)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_heads=4, n_kv_heads=4),  # GQA ratio 1
        dict(n_heads=4, n_kv_heads=2, tie_embeddings=True),  # ratio 2, tied (like 0.6B-4B)
        dict(n_heads=8, n_kv_heads=2, head_dim=16),  # ratio 4, n_heads * head_dim (128) != dim (64)
    ],
)
def test_qwen3_dense_matches_hf(kw):
    args = _qwen(**kw)
    hf_model, _, _ = _check(args, qwen3_hf, Qwen3)
    _check_round_trip(hf_model.state_dict(), args, qwen3_hf)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, n_kv_heads=1),
        dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, tie_embeddings=True),
    ],
)
def test_qwen3_moe_matches_hf(kw):
    args = _qwen(moe_hidden_dim=32, **kw)
    hf_model, ours, tokens = _check(args, qwen3_hf, Qwen3)
    _check_round_trip(hf_model.state_dict(), args, qwen3_hf)

    # Routing: same experts and weights for the same hidden states.
    x = torch.randn(40, args.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_scores, hf_experts = hf_model.model.layers[1].mlp.gate(x)
        scores, experts, _ = ours.layers["1"].moe.router(x)
    assert torch.equal(experts, hf_experts)
    assert (scores - hf_scores).abs().max().item() <= 1e-6

    # Aux loss: ours is the per-layer Switch loss summed over layers; HF's function on one
    # layer's router logits is that layer's loss.
    with torch.no_grad():
        out = hf_model(tokens, output_router_logits=True)
    expected = sum(
        transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func(
            (logits,), args.num_experts, args.num_experts_per_tok
        )
        for logits in out.router_logits
    )
    assert abs(ours.pop_aux_loss().item() - expected.item()) <= 1e-5
    assert expected.item() > 0


def _check_round_trip(hf_sd, args, hf_module):
    ours_sd = hf_module.from_hf(hf_sd, args)
    back = hf_module.to_hf(ours_sd, args)
    if args.tie_embeddings:
        assert "lm_head.weight" not in back
        hf_sd = {k: v for k, v in hf_sd.items() if k != "lm_head.weight"}
    if getattr(args, "num_experts", 0):
        # to_hf writes the hub layout (one tensor per expert); check it against HF's fused tensors.
        fused = hf_module.to_hf(ours_sd, args, fused_experts=True)
        assert fused.keys() == hf_sd.keys()
        assert all(torch.equal(fused[k], hf_sd[k]) for k in hf_sd)
        layer0 = hf_sd["model.layers.0.mlp.experts.gate_up_proj"]
        hidden = args.moe_hidden_dim
        assert torch.equal(back["model.layers.0.mlp.experts.1.gate_proj.weight"], layer0[1, :hidden])
        assert torch.equal(back["model.layers.0.mlp.experts.1.up_proj.weight"], layer0[1, hidden:])
        # The hub layout converts back to the same model state.
        again = hf_module.from_hf(back, args)
        assert all(torch.equal(again[k], ours_sd[k]) for k in ours_sd)
        return
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_hf_config_round_trip():
    for args, module in (
        (_llama(n_kv_heads=2, rope_scaling_factor=8.0), llama3_hf),
        (_llama(tie_embeddings=True), llama3_hf),
        (_qwen(tie_embeddings=True), qwen3_hf),
        (_qwen(num_experts=8, num_experts_per_tok=2, moe_hidden_dim=32), qwen3_hf),
    ):
        parsed = module.args_from_hf_config(module.hf_config(args))
        # Llama's FFN width comes back as an explicit hidden_dim instead of multiple_of/multiplier.
        assert parsed.shape() == args.shape()
        assert module.hf_config(parsed) == module.hf_config(args)
        assert parsed.num_params() == args.num_params()
    assert qwen3_hf.args_from_hf_config(qwen3_hf.hf_config(args)) == args  # Qwen: exact
    # transformers 5 writes `rope_parameters` instead of rope_theta/rope_scaling; both parse.
    args = _llama(rope_scaling_factor=8.0)
    cfg = transformers.LlamaConfig(**llama3_hf.hf_config(args)).to_dict()
    assert "rope_parameters" in cfg
    assert llama3_hf.hf_config(llama3_hf.args_from_hf_config(cfg)) == llama3_hf.hf_config(args)


def test_from_hf_rejects_unknown_and_missing_keys():
    args = _llama()
    hf_sd = _hf_model(llama3_hf.hf_config(args)).state_dict()
    with pytest.raises(ValueError, match="model.layers.0.mlp.bogus"):
        llama3_hf.from_hf({**hf_sd, "model.layers.0.mlp.bogus": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match="lm_head.weight"):
        llama3_hf.from_hf({k: v for k, v in hf_sd.items() if k != "lm_head.weight"}, args)
    with pytest.raises(ValueError, match="rope_type"):
        llama3_hf.args_from_hf_config({**llama3_hf.hf_config(args), "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def test_load_balance_loss_matches_hf_function():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 6, generator=gen)
    top_k = 2
    selected = torch.topk(torch.softmax(logits, -1), top_k, dim=-1).indices
    counts = torch.bincount(selected.flatten(), minlength=6)
    expected = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func((logits,), 6, top_k)
    assert abs(load_balance_loss(logits, counts, 6).item() - expected.item()) <= 1e-6
