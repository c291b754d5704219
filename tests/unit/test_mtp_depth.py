"""DeepSeek-V3 / Kimi K2 multi-token prediction deeper than the release's one module (`mtp_depth` > 1,
docs/models.md "Multi-token prediction"): the HF layout of every depth both ways, what a shallower
model takes from a deeper checkpoint, and that each module reads the depth before (the paper's
sequential chain; the loss per depth against the paper's equations at D = 2 is
tests/unit/test_mtp.py's)."""

from __future__ import annotations

import torch

from models.deepseek_v3 import hf_adapter as ds_hf
from tests.unit.test_mtp import _model


def test_every_depth_is_its_own_hf_layer_both_ways():
    """D = 3: module k is HF layer n_layers + k - 1, each with its own enorm / hnorm / eh_proj /
    shared_head.norm and block (the three differ) and copies of the shared embedding and head; the
    state dict comes back bit for bit; `hf_config` says num_nextn_predict_layers = 3. A depth-1
    model reading that export takes layer n_layers only (module 1's weights, the same tensors) and
    drops the deeper two; a depth-0 model drops all three."""
    model = _model(depth=3)
    args = model.args
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    hf = ds_hf.to_hf(sd, args)
    for k in range(1, 4):
        layer = f"model.layers.{args.n_layers + k - 1}."
        for rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
            assert layer + rest in hf, (k, rest)
        assert torch.equal(hf[layer + "eh_proj.weight"], sd[f"mtp.{k - 1}.eh_proj.weight"])
        assert torch.equal(hf[layer + "embed_tokens.weight"], sd["tok_embeddings.weight"])
        assert torch.equal(hf[layer + "shared_head.head.weight"], sd["output.weight"])
    assert f"model.layers.{args.n_layers + 3}.eh_proj.weight" not in hf
    projections = [sd[f"mtp.{k}.eh_proj.weight"] for k in range(3)]
    assert not torch.equal(projections[0], projections[1]) and not torch.equal(projections[1], projections[2])
    back = ds_hf.from_hf(hf, args)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert ds_hf.hf_config(args)["num_nextn_predict_layers"] == 3
    one = ds_hf.from_hf(hf, _model(depth=1).args)
    assert {k for k in one if k.startswith("mtp.")} == {k for k in sd if k.startswith("mtp.0.")}
    assert all(torch.equal(one[k], sd[k]) for k in one)
    assert not any(k.startswith("mtp.") for k in ds_hf.from_hf(hf, _model(depth=0).args))


def test_each_depth_reads_the_depth_before():
    """D = 2, the sequential chain: changing module 1's block changes depth 2's output (depth 2 reads
    h^1), changing module 2 leaves depth 1's output as it was, and the main hidden state is the
    same whatever the modules hold."""
    model = _model(depth=2)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = [h.clone() for h in model.mtp_hidden(tokens)]
        model.pop_aux_loss()
        model.mtp[1].eh_proj.weight.mul_(1.5)
        second = model.mtp_hidden(tokens)
        model.pop_aux_loss()
        assert torch.equal(second[0], base[0]) and torch.equal(second[1], base[1])
        assert not torch.allclose(second[2], base[2])
        model.mtp[0].eh_proj.weight.mul_(1.5)
        first = model.mtp_hidden(tokens)
        model.pop_aux_loss()
    assert torch.equal(first[0], base[0])
    assert not torch.allclose(first[1], base[1]) and not torch.allclose(first[2], second[2])
