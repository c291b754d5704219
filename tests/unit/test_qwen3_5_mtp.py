"""Qwen 3.5's multi-token prediction (`[model] mtp_depth = 1`; the hub checkpoints' `mtp.*`).

transformers loads none of the MTP module (its `_keys_to_ignore_on_load_unexpected` drops `mtp.*`),
so there is no reference forward to compare with: the module is checked against its equations
(the serving code's: fc over [norm(embedding of token i + 1) | norm(main final-normed hidden)],
full-attention blocks, a final norm), the main model is checked unchanged by it, the HF names
both ways (exact round trip, the hub's names), the counts, the refusals, and a debug run that
logs and learns the MTP loss.
"""

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
