"""Qwen 3.5 family: HF logits parity (dense and MoE), the chunked gated delta rule against its
recurrent reference, HF round trips, flavors, the plan (EP against one process, the TP rule), and
the debug recipe training in-process.

Parity bound (fp32): our chunked delta rule performs transformers' `torch_chunk_gated_delta_rule`
operations in the same order (bit-identical, asserted below), so the model differences come from
the rest: SDPA vs HF's eager attention in the full-attention block, grouped expert matmuls and a
weighted sum in choice order vs HF's per-expert loop with index_add (MoE). fp32 eps is 1.2e-7; a
reduction of K <= 96 terms moves a result by about sqrt(K) eps ~ 1e-6 relative, and 4 blocks plus
the output projection compound a few of those: we bound the max logit difference by 1e-5 x
max |logit| (the gpt-oss and DeepSeek-V3 bound; measured ~3e-7 relative). A wrong gate, norm
centring, rotary width or conv tap moves logits by 1e-2 or more.

Chunked vs recurrent bound (fp32): the two orders of the same sums differ by rounding only. With
l2-normalised q/k and beta, exp(g) in (0, 1] the state's entries stay O(|v|) and each output is a
sum of ~k_dim x (chunk) products of O(1) terms, so 1e-5 x max|out| (and the same for the state)
is ~100 eps: measured ~3e-7.
"""

import dataclasses

import pytest
import torch
import transformers  # the [dev] extra

import models
from models.common.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.qwen3_5 import FLAVORS, Qwen3_5Transformer
from models.qwen3_5 import hf_adapter as qwen3_5_hf
from models.qwen3_5.plan import PLAN

REL_TOL = 1e-5
SEQ = 150  # three chunks of 64, the last one padded


def _args(moe: bool = False, **kw):
    base = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=160,
        hidden_dim=96,
        max_seq_len=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
    )
    if moe:
        base.update(
            hidden_dim=12288, num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_hidden_dim=48
        )
    return dataclasses.replace(FLAVORS["debugmodel"], **{**base, **kw})


def _hf_model(args):
    cfg = {k: v for k, v in qwen3_5_hf.hf_config(args).items() if k not in ("architectures", "model_type")}
    if args.is_moe:
        config, cls = transformers.Qwen3_5MoeTextConfig(**cfg), transformers.Qwen3_5MoeForCausalLM
    else:
        config, cls = transformers.Qwen3_5TextConfig(**cfg), transformers.Qwen3_5ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = cls(config).eval()
    with torch.no_grad():  # the norms start at zero (scale 1): move them so a wrong centring shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    return model


def _ours(args, hf_model):
    model = Qwen3_5Transformer(args).eval()
    model.load_state_dict(qwen3_5_hf.from_hf(hf_model.state_dict(), args), strict=True)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers(moe):
    args = _args(moe)
    hf_model = _hf_model(args)
    ours = _ours(args, hf_model)
    assert [type(b.attention).__name__ for b in ours.layers.values()] == [
        "GatedDeltaNet",
        "GatedDeltaNet",
        "GatedDeltaNet",
        "GatedAttention",
    ]
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model(tokens).logits
        got = ours(tokens)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= REL_TOL * scale, (err, scale)
    # Sensitivity: the attention's output gate, the norms' centring and a conv tap each matter.
    bound = 1e3 * REL_TOL * scale
    with torch.no_grad():
        gate_rows = ours.layers["3"].attention.wq.weight.view(args.n_heads, 2, args.head_dim, -1)[:, 1]
        gate_rows.mul_(3)
        assert (ours(tokens) - want).abs().max().item() > bound
        gate_rows.div_(3)
        ours.norm.weight.add_(1)  # a norm scaled by weight, not 1 + weight, differs by this much
        assert (ours(tokens) - want).abs().max().item() > bound
        ours.norm.weight.sub_(1)
        ours.layers["0"].attention.conv1d.weight[:, :, 0].mul_(3)
        assert (ours(tokens) - want).abs().max().item() > bound


def _delta_inputs(b=2, s=150, hk=2, hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, hk, dk, generator=gen), torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, hv, dv, generator=gen)
    g = -torch.rand(b, s, hv, generator=gen) * 0.5
    beta = torch.rand(b, s, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _close(got, want):
    return (got - want).abs().max().item() <= REL_TOL * want.abs().max().item()


def test_chunked_delta_rule_matches_recurrent_reference():
    q, k, v, g, beta, state = _delta_inputs()
    common = dict(initial_state=state, output_final_state=True, qk_l2norm=True)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    for chunk in (16, 64):
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, **common)
        assert _close(out, want_out) and _close(final, want_state), chunk
    # The same operations as transformers' torch fallback: bit-identical.
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    hf_out, hf_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=64, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **common)
    assert torch.equal(out, hf_out) and torch.equal(final, hf_state)
    # State passing (what CP would do): two halves with the state handed over = the whole.
    first, mid = chunk_gated_delta_rule(*(t[:, :70] for t in (q, k, v, g, beta)), chunk_size=16, **common)
    second, last = chunk_gated_delta_rule(
        *(t[:, 70:] for t in (q, k, v, g, beta)),
        chunk_size=16,
        initial_state=mid,
        output_final_state=True,
        qk_l2norm=True,
    )
    assert _close(torch.cat([first, second], dim=1), want_out) and _close(last, want_state)


def test_delta_rule_reset_restarts_the_state():
    q, k, v, g, beta, state = _delta_inputs()
    reset = torch.zeros(2, 150, dtype=torch.bool)
    reset[0, [40, 64, 65]] = True  # mid-chunk, on a chunk boundary, twice in a row
    reset[1, [0, 127]] = True
    common = dict(initial_state=state, output_final_state=True, qk_l2norm=True, reset=reset)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, **common)
    assert _close(out, want_out) and _close(final, want_state)
    # A reset segment computes what it computes alone from a zero state.
    alone, _ = chunk_gated_delta_rule(*(t[:1, 40:64] for t in (q, k, v, g, beta)), chunk_size=32, qk_l2norm=True)
    assert _close(out[:1, 40:64], alone)


def test_packed_documents_equal_separate_rows():
    """segment_ids: the conv, the delta rule and the full attention stay inside each document."""
    args = _args(delta_chunk_size=16)
    torch.manual_seed(0)
    model = Qwen3_5Transformer(args).eval()
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (1, 60), generator=torch.Generator().manual_seed(3))
    segment_ids = torch.tensor([[0] * 23 + [1] * 37])
    positions = torch.cat([torch.arange(23), torch.arange(37)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, segment_ids, positions)
        parts = torch.cat([model(tokens[:, :23]), model(tokens[:, 23:])], dim=1)
    assert _close(packed, parts)


def test_hf_state_dict_round_trip_is_exact():
    for moe in (False, True):
        args = _args(moe)
        hf_sd = _hf_model(args).state_dict()
        ours = qwen3_5_hf.from_hf(hf_sd, args)
        back = qwen3_5_hf.to_hf(ours, args, fused_experts=True)
        assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
        # ours -> HF hub layout (per-expert tensors) -> ours, and the multimodal checkpoint's keys.
        hub = qwen3_5_hf.to_hf(ours, args)
        again = qwen3_5_hf.from_hf(hub, args)
        assert set(again) == set(ours) and all(torch.equal(again[k], ours[k]) for k in ours)
        multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in hub.items()}
        multimodal["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
        multimodal["mtp.fc.weight"] = torch.zeros(3, 3)
        again = qwen3_5_hf.from_hf(multimodal, args)
        assert set(again) == set(ours) and all(torch.equal(again[k], ours[k]) for k in ours)
    with pytest.raises(ValueError, match=r"^layers\.3\.attention\.wq\.weight: missing"):
        qwen3_5_hf.from_hf({k: v for k, v in hf_sd.items() if "layers.3.self_attn.q_proj" not in k}, args)
    assert models.HF_MODEL_TYPES["qwen3_5_moe"] == "qwen3_5"


def test_flavors_registry_and_config_round_trip():
    family = models.get_model_family("qwen3_5")
    assert family.model_cls is Qwen3_5Transformer and family.document_mask  # segment ids, positions, CP
    # The non-debug flavors are transformers' config defaults (module docstring of args.py).
    assert qwen3_5_hf.args_from_hf_config(transformers.Qwen3_5TextConfig().to_dict()) == FLAVORS["9B"]
    assert qwen3_5_hf.args_from_hf_config(transformers.Qwen3_5MoeTextConfig().to_dict()) == FLAVORS["35B-A3B"]
    multimodal = transformers.Qwen3_5MoeConfig().to_dict()
    assert qwen3_5_hf.args_from_hf_config(multimodal) == FLAVORS["35B-A3B"]
    for name, args in FLAVORS.items():
        assert qwen3_5_hf.args_from_hf_config(qwen3_5_hf.hf_config(args)) == args, name
    for name in ("debugmodel", "debugmodel_moe", "9B", "35B-A3B"):
        with torch.device("meta"):
            model = Qwen3_5Transformer(FLAVORS[name])
        assert sum(p.numel() for p in model.parameters()) == FLAVORS[name].num_params(), name
    # The names' sizes: 8.95B (its 2 x 1.02B untied embedding and output included) and 34.7B with
    # 3.45B active per token.
    assert FLAVORS["9B"].num_params() == pytest.approx(8.954e9, rel=1e-3)
    assert FLAVORS["35B-A3B"].num_params() == pytest.approx(34.66e9, rel=1e-3)
    assert FLAVORS["35B-A3B"].num_active_params() == pytest.approx(3.455e9, rel=1e-3)
    with pytest.raises(ValueError, match="layer_types"):
        qwen3_5_hf.args_from_hf_config({**qwen3_5_hf.hf_config(FLAVORS["9B"]), "layer_types": ["full_attention"] * 32})


def test_parallelism_rules_refuse_tp_and_allow_cp():
    from models.errors import ConfigError
    from trainer.config import build_config
    from trainer.job import plan_job
    from trainer.step.plan import StepRequest, refusals

    refusal = Qwen3_5Transformer.tp_refusal
    assert refusals(StepRequest(tp_degree=2, tp_refusal=refusal)) == [
        f"parallelism.tensor_parallel_degree: {refusal}; allowed for this model: 1"
    ]
    assert refusals(StepRequest(tp_degree=1, tp_refusal=refusal)) == []
    with pytest.raises(ConfigError, match=r"^parallelism\.tensor_parallel_degree: .*allowed for this model: 1$"):
        plan_job(  # the job's step request carries the family's refusal (trainer/job.py step_request)
            build_config("configs/qwen3_5_debug.toml", [("parallelism.tensor_parallel_degree", "2")]),
            world_size=2,
            device_type="cpu",
        )
    # CP: the Gated DeltaNet's ops pass the state between ranks (tests/unit/test_cp_linear_attention.py);
    # with MTP it stays refused (the MTP rule: the module's shift crosses the cp chunks).
    plan_job(
        build_config("configs/qwen3_5_debug.toml", [("parallelism.context_parallel_degree", "2")]),
        world_size=2,
        device_type="cpu",
    )
    with pytest.raises(ConfigError, match=r"^model\.mtp_depth: 1 .*context_parallel_degree 2"):
        plan_job(
            build_config(
                "configs/qwen3_5_debug.toml",
                [("parallelism.context_parallel_degree", "2"), ("model.mtp_depth", "1")],
            ),
            world_size=2,
            device_type="cpu",
        )


def test_ep_matches_single_process():
    """Experts split over ep (the shared expert and its gate per token, like the router) with
    FSDP: loss and every gradient equal one process on the global batch."""
    from tests.support.parallel_harness import SEQ_LEN, assert_matches_single_process, batch

    args = _args(True, vocab_size=256, max_seq_len=SEQ_LEN, delta_chunk_size=8)
    inputs, labels = batch(args.vocab_size, 2)
    # dt_bias / A_log gradients are sums over every token and channel of terms that nearly
    # cancel (|grad| ~ 1e-5 from terms ~ 1e-3): their relative rounding is ~100x larger.
    assert_matches_single_process(
        Qwen3_5Transformer,
        args,
        PLAN,
        dict(dp_shard=2, ep=2),
        inputs,
        labels,
        tolerance=lambda name: 1e-4 if name.endswith(("dt_bias", "A_log")) else 1e-5,
    )


@pytest.mark.parametrize("recipe", ["qwen3_5_debug", "qwen3_5_moe_debug"])
def test_debug_recipe_trains_in_process(tmp_path, monkeypatch, recipe):
    """The debug recipes train a few fp32 steps through the trainer (with activation
    checkpointing of the hybrid blocks) and the loss falls."""
    from tests.support.trainer_runs import assert_recipe_learns

    overrides = {"training.seq_len": 64, "training.local_batch_size": 4, "activation_checkpoint.mode": "full"}
    assert_recipe_learns(monkeypatch, f"configs/{recipe}.toml", tmp_path / "run", overrides)
