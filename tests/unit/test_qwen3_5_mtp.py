"""Qwen 3.5's multi-token prediction (`[model] mtp_depth = 1`; the hub checkpoints' `mtp.*`).

transformers loads none of the MTP module (its `_keys_to_ignore_on_load_unexpected` drops `mtp.*`),
so there is no whole reference forward: the module is checked against a reference composed of
transformers' own parts with our exported weights (its RMSNorm and full-attention decoder layer;
the layout is the serving code's: fc over [norm(embedding of token i + 1) | norm(main
final-normed hidden)], full-attention blocks, a final norm), against its equations, the loss and
gradients against truncated sequences, the main model unchanged by it, the HF names both ways
(exact round trip, the hub's names), the counts, the refusals, and a debug run that logs and
learns the MTP loss."""

import dataclasses

import pytest
import torch

from models.qwen3_5 import hf_adapter as hf
from models.qwen3_5.args import FLAVORS, Qwen3_5Args
from models.qwen3_5.model import Qwen3_5Transformer


def _model(flavor: str, **changes) -> Qwen3_5Transformer:
    torch.manual_seed(0)
    model = Qwen3_5Transformer(dataclasses.replace(FLAVORS[flavor], **changes))
    model.init_weights()
    for p in model.parameters():  # zero-centred norms start at 0: move every weight off its init
        p.data.add_(0.02 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_mtp_module_follows_its_equations_and_leaves_the_main_model_unchanged(flavor):
    model = _model(flavor, mtp_depth=1)
    tokens = torch.randint(0, model.args.vocab_size, (2, 48))
    with torch.no_grad():
        main, mtp = model.mtp_hidden(tokens)
        # the main path: what the model without MTP computes from the same weights
        plain = Qwen3_5Transformer(dataclasses.replace(model.args, mtp_depth=0))
        missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
        assert not missing and unexpected and all(k.startswith("mtp.") for k in unexpected)
        assert torch.equal(main, plain.hidden(tokens)) and torch.equal(model(tokens), plain(tokens))
        # the module by hand: token i + 1's embedding (zero past the end) beside main's hidden state
        emb = model.tok_embeddings(tokens)
        emb_next = torch.cat([emb[:, 1:], torch.zeros_like(emb[:, :1])], dim=1)
        m = model.mtp
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(emb_next), m.pre_fc_norm_hidden(main)], dim=-1))
        cos, sin = model.rope_cos[:48], model.rope_sin[:48]
        for block in m.layers.values():
            out = block(x, cos, sin)
            x = out[0] if isinstance(out, tuple) else out
        assert torch.allclose(mtp, m.norm(x), rtol=0, atol=1e-6)
    assert model.args.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor, fused", [("debugmodel", False), ("debugmodel_moe", False), ("debugmodel_moe", True)])
def test_hf_names_both_ways_with_the_mtp_module(flavor, fused):
    model = _model(flavor, mtp_depth=1)
    ours = model.state_dict()
    theirs = hf.to_hf(ours, model.args, fused_experts=fused)
    for name in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"):
        assert torch.equal(theirs[f"mtp.{name}"], ours[f"mtp.{name}"])
    assert torch.equal(theirs["mtp.layers.0.self_attn.q_proj.weight"], ours["mtp.layers.0.attention.wq.weight"])
    if not model.args.is_moe:  # a released dense checkpoint's count: fc, 3 norms and one full-attention layer
        assert sum(k.startswith("mtp.") for k in theirs) == 15
    back = hf.from_hf(theirs, model.args)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    # mtp_depth = 0 drops the module (as transformers does); = 1 needs it, and knows its names
    off = dataclasses.replace(model.args, mtp_depth=0)
    assert not any(k.startswith("mtp.") for k in hf.from_hf(theirs, off))
    with pytest.raises(ValueError, match=r"^mtp\.fc\.weight: missing .* allowed: .*mtp_depth = 0"):
        hf.from_hf({k: v for k, v in theirs.items() if k != "mtp.fc.weight"}, model.args)
    with pytest.raises(ValueError, match=r"^mtp\.extra\.weight: unknown .* allowed: mtp\.fc\.weight"):
        hf.from_hf({**theirs, "mtp.extra.weight": torch.zeros(1)}, model.args)
    assert hf.args_from_hf_config(hf.hf_config(model.args)).mtp_layers == 1


def test_keys_checked():
    for bad, key in ((dict(mtp_depth=2), "mtp_depth"), (dict(mtp_layers=0), "mtp_layers")):
        with pytest.raises(ValueError, match=rf"^{key}: .*allowed:"):
            Qwen3_5Args(**bad)
    with pytest.raises(ValueError, match=r"^mtp_loss_weight: .*allowed:"):
        Qwen3_5Args(mtp_loss_weight=float("inf"))
    with pytest.raises(ValueError, match=r"^mtp_layers: 2 with mtp_depth 1; allowed: 1 with mtp_depth 1"):
        Qwen3_5Args(mtp_depth=1, mtp_layers=2)
    assert Qwen3_5Args(mtp_layers=2).mtp_layers == 2  # a config with more MTP layers loads at depth 0
    # the rules: CP (the MTP rule) and PP (the pipeline rule) refused in one line each
    from models.errors import ConfigError
    from trainer.config import build_config
    from trainer.job import plan_job

    for key, value, rule in (
        ("parallelism.context_parallel_degree", "2", r"^model\.mtp_depth: 1 "),
        ("parallelism.pipeline_parallel_degree", "2", r"^parallelism\.pipeline_parallel_degree: 2 .*mtp_depth 1"),
    ):
        cfg = build_config("configs/qwen3_5_debug.toml", [("model.mtp_depth", "1"), (key, value)])
        with pytest.raises(ConfigError, match=rule):
            plan_job(cfg, world_size=2, device_type="cpu")


def test_flops_count_the_mtp_block_and_head():
    from trainer.runtime.flops import model_flops_per_token

    off, on = FLAVORS["debugmodel"], dataclasses.replace(FLAVORS["debugmodel"], mtp_depth=1)
    seq_len = 256
    extra = model_flops_per_token(on, seq_len)["palm"] - model_flops_per_token(off, seq_len)["palm"]
    params = on.num_active_params(exclude_embedding=True) - off.num_active_params(exclude_embedding=True)
    head = on.vocab_size * on.dim
    assert extra == pytest.approx(6 * (params + head) + 12 * on.n_heads * on.head_dim * seq_len)


def test_debug_run_logs_the_mtp_loss_and_learns(tmp_path):
    """The Qwen 3.5 debug recipe with mtp_depth = 1 trains in process: `mtp_loss_1` is logged
    beside the main loss, and both fall."""
    from tests.support.trainer_runs import train_in_process

    overrides = {
        "model.mtp_depth": "1",
        "model.n_layers": "4",
        "training.seq_len": "64",
        "training.local_batch_size": "4",
        "training.steps": "8",
    }
    records = list(train_in_process("configs/qwen3_5_debug.toml", tmp_path, overrides).values())
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all("mtp_loss_1" in r and "mtp_loss_2" not in r for r in records)
    first, last = records[0], records[-1]
    assert first["loss"] > 7.5 and first["mtp_loss_1"] > 7.5  # ~ ln(4096) at init
    assert last["loss"] < first["loss"] - 0.5 and last["mtp_loss_1"] < first["mtp_loss_1"] - 0.5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_module_equals_transformers_building_blocks(moe):
    """(a) The MTP output against a reference made of transformers' own Qwen 3.5 parts with our
    weights, exported by `to_hf` (so the hub names are checked by strict loads too): the main
    model's final-normed hidden state from `Qwen3_5(Moe)ForCausalLM`, `Qwen3_5RMSNorm` for the
    two input norms and the final norm, a `Qwen3_5(Moe)DecoderLayer` of the full-attention kind
    for `mtp.layers.0`, the text model's rotary table and causal mask, `fc` as the matmul.

    Bound (fp32): the parts are the family's logits-parity parts (tests/unit/test_qwen3_5.py: SDPA
    vs transformers' eager attention, grouped vs looped experts; measured ~3e-7 relative), two
    more norms and one 2 dim -> dim matmul of K = 128 terms (~sqrt(K) eps ~ 1e-6): 1e-5 x
    max|reference| as there. Wiring errors move the output by O(1): the reference with the
    concatenation's halves swapped, or fed the hidden state before the final norm, is checked to
    be more than 1e3 x the bound away."""
    from transformers.masking_utils import create_causal_mask

    from tests.unit.test_qwen3_5 import REL_TOL, SEQ, _args, _hf_model

    if moe:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Norm
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm

    args = _args(moe, mtp_depth=1)
    hf_model = _hf_model(dataclasses.replace(args, mtp_depth=0))  # transformers' main model (no mtp.*)
    ours = Qwen3_5Transformer(args).eval()
    state = hf.from_hf(hf_model.state_dict(), dataclasses.replace(args, mtp_depth=0))
    torch.manual_seed(7)
    ours.mtp.init_weights()
    with torch.no_grad():
        for p in ours.mtp.parameters():  # every MTP weight off its init (zero-centred norms start at 0)
            p.add_(0.05 * torch.randn_like(p))
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(k.startswith("mtp.") for k in missing)
    exported = hf.to_hf(ours.state_dict(), args, fused_experts=True)  # transformers 5's in-memory experts

    config = hf_model.config
    full = args.n_layers - 1  # the stack's full-attention block: a layer index of that kind
    assert config.layer_types[full] == "full_attention"
    layer = Layer(config, full).eval()
    layer.load_state_dict({k[len("mtp.layers.0.") :]: v for k, v in exported.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Norm(args.dim, eps=config.rms_norm_eps)
        norms[name].load_state_dict({"weight": exported[f"mtp.{name}.weight"]})
    fc = exported["mtp.fc.weight"]

    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = hf_model.model
        hidden = base(tokens).last_hidden_state  # final-normed
        emb = base.embed_tokens(tokens)
        emb_next = torch.cat([emb[:, 1:], torch.zeros_like(emb[:, :1])], dim=1)
        positions = torch.arange(SEQ)[None].expand(2, -1)

        def reference(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            x = torch.cat([norms["pre_fc_norm_embedding"](first), norms["pre_fc_norm_hidden"](second)], -1) @ fc.T
            mask = create_causal_mask(
                config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
            )
            rope = base.rotary_emb(x, positions[None].expand(3, -1, -1))
            out = layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
            return norms["norm"](out[0] if isinstance(out, tuple) else out)

        want = reference(emb_next, hidden)
        main, got = ours.mtp_hidden(tokens)
    scale = want.abs().max().item()
    assert (main - hidden).abs().max().item() <= REL_TOL * hidden.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * scale, (err, scale)
    with torch.no_grad():
        swapped = reference(hidden, emb_next)  # [hidden | embedding]
        seen = []  # the final norm's input: the last block's output
        hook = base.norm.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
        base(tokens)
        hook.remove()
        unnormed = reference(emb_next, seen[0])
    for wrong in (swapped, unnormed):
        assert (got - wrong).abs().max().item() > 1e3 * REL_TOL * scale
    print(f"MTP vs transformers' parts ({'moe' if moe else 'dense'}): {err:.2e} of max {scale:.3f} ({err / scale:.1e})")


def test_mtp_loss_and_gradients_match_the_truncated_reference():
    """(b), (c) The trainer's `MTPLoss` on Qwen 3.5 (depth 1, weight 0.3) against the equations on
    truncated sequences: the module runs on the T - 1 positions that have a next token, its
    output through the shared head predicts t[i + 2] = labels[:, i + 1]; L = L_main + 0.3 L_1.
    The returned value is L_main bit for bit that of the model without MTP (same weights); L_1 and
    every parameter's gradient of L equal the reference's (fp32; the two differ only in the
    zero-embedded last position, which causal attention keeps from the others, and in the
    reduction order of the mean: 1e-6 relative on the loss, 1e-5 of each gradient's max plus
    1e-6 of the largest for the decay gates' cancelling sums). A target shifted by one place
    more or less moves L_1 by O(1) (checked)."""
    import torch.nn.functional as F

    from trainer.step.loss import MTPLoss, model_lm_loss

    model = _model("debugmodel", mtp_depth=1, n_layers=2, vocab_size=512, max_seq_len=32)
    window = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(3))
    inputs, labels = window[:, :-1], window[:, 1:]
    loss_fn = MTPLoss(fused=False, depth=1, weight=0.3)
    main = loss_fn(model, inputs, labels)
    (mtp_1,) = loss_fn._last
    main.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain = Qwen3_5Transformer(dataclasses.replace(model.args, mtp_depth=0))
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert torch.equal(main, model_lm_loss(plain, inputs, labels, fused=False))

    model.zero_grad()
    seq = inputs.shape[1]
    cos, sin = model.rope_cos[: seq - 1], model.rope_sin[: seq - 1]
    emb = model.tok_embeddings(inputs)
    hidden = model.norm(model.layers(emb, model.rope_cos[:seq], model.rope_sin[:seq]))
    ref_main = F.cross_entropy(model.output(hidden).flatten(0, 1).float(), labels.flatten())
    m = model.mtp
    x = m.fc(torch.cat([m.pre_fc_norm_embedding(emb[:, 1:]), m.pre_fc_norm_hidden(hidden[:, :-1])], dim=-1))
    h = m.layers(x, cos, sin)
    ref_1 = F.cross_entropy(model.output(m.norm(h)).flatten(0, 1).float(), labels[:, 1:].flatten())
    (ref_main + 0.3 * ref_1).backward()
    assert torch.allclose(main, ref_main, rtol=1e-6, atol=0) and torch.allclose(mtp_1, ref_1, rtol=1e-6, atol=0)
    # The DeltaNet decay gates' gradients (A_log, dt_bias) are small sums of cancelling terms (the
    # CP parity notes 1.3e-4 of their own max between two delta-rule chunkings): their rounding is
    # that of the terms, so each bound adds 1e-6 of the largest gradient of the model.
    largest = max(p.grad.abs().max() for p in model.parameters())
    for name, p in model.named_parameters():
        assert (got[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-6 * largest, name
    assert got["mtp.fc.weight"].abs().max() > 0 and got["mtp.layers.0.attention.wq.weight"].abs().max() > 0
    with torch.no_grad():  # the depth's shift matters: t[i + 1] or t[i + 3] as targets are far off
        logits = model.output(m.norm(h)).float()
        for wrong in (labels[:, :-1], torch.cat([labels[:, 2:], labels[:, :1]], dim=1)):
            assert abs(F.cross_entropy(logits.flatten(0, 1), wrong.flatten()) - ref_1) > 1e3 * 1e-6 * ref_1


def test_planner_counts_the_mtp_module_as_eager_keeps_it():
    """The planner's Qwen 3.5 MTP terms (planner/activations.py `_hybrid`, through
    planner/search.py `PlanInputs.activations`) against what eager autograd keeps more with
    `mtp_depth = 1` than without (the planner's recorder, bf16, 128 tokens, AC none, the
    dense debug flavor): within 64 B per token. Planned 41,668 B per token, 0.1 % below eager
    (39,748, -4.5 %, before the full-attention block's output gate, q / k norms and RoPE rows:
    tests/unit/test_planner_delta_block.py); without the MTP terms the difference would be 0."""
    import planner.activations as P
    from models import FAMILIES
    from planner.search import PlanInputs
    from trainer.step import lm_loss
    from trainer.step.loss import MTPLoss

    b, s = 1, 128
    tokens = torch.randint(0, 4096, (b, s + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    kept, planned = {}, {}
    for depth in (0, 1):
        args = dataclasses.replace(FLAVORS["debugmodel"], mtp_depth=depth)
        torch.manual_seed(0)
        model = Qwen3_5Transformer(args).bfloat16()
        if depth:
            loss_fn = MTPLoss(fused=False, depth=1, weight=0.3)
            kept[depth] = P.saved_bytes(model, lambda: loss_fn(model, x, y))
        else:
            kept[depth] = P.measure_saved_bytes(model, x, y, loss_fn=lm_loss)
        inputs = PlanInputs(family=FAMILIES["qwen3_5"], args=args, model_name="qwen3_5", seq_len=s, local_batch_size=b)
        planned[depth] = inputs.activations(local_batch_size=b, tp=1, ac_mode="none").total
    measured, plan = kept[1] - kept[0], planned[1] - planned[0]
    assert abs(plan - measured) <= 64 * b * s, (plan / (b * s), measured / (b * s))
    assert plan == 41668 * b * s


def test_the_fused_loss_keeps_one_log_sum_exp_per_pass_over_the_head():
    """With `[training] fused_loss` the loss keeps one fp32 log-sum-exp per token and pass over the
    head: with MTP depth 1 two passes (the main head and the module's), not one as the planner
    counted (planner/memory.py `_saved_activations`, `ActivationBytes.loss_passes`)."""
    from types import SimpleNamespace

    from models import FAMILIES
    from planner.memory import _saved_activations
    from planner.search import PlanInputs

    b, s = 2, 128
    loss = {}
    for depth in (0, 1):
        args = dataclasses.replace(FLAVORS["debugmodel"], mtp_depth=depth)
        inputs = PlanInputs(family=FAMILIES["qwen3_5"], args=args, model_name="qwen3_5", seq_len=s, local_batch_size=b)
        acts = _saved_activations(
            inputs.activations(local_batch_size=b, tp=1, ac_mode="full"),
            args.shape(),
            parallel_dims=SimpleNamespace(tp=1, cp=1, ep=1),
            local_batch_size=b,
            seq_len=s,
            ac_mode="full",
            loss_parallel=False,
            fused_loss=True,
            moe_capacity_factor=0.0,
            moe_layers=None,
        )
        loss[depth] = acts.loss
    assert loss == {0: 4 * b * s, 1: 2 * 4 * b * s}
