"""The planner on FLUX (planner/flux.py, scripts/estimate.py with a flow recipe).

The activation model is checked against what autograd really keeps: `planner.activations.
saved_bytes` of a bf16 FLUX debugmodel forward + the trainer's flow loss (SimpleFSDP bf16
parameters, as the trainer runs it), per block = (model with one more block of a kind) -
(model without it). Bound: the no-AC count leaves out a few per-sample adaLN tensors (the
modulation chunks the gate multiplies keep: 6 x hidden bytes per sample per double block,
0.35 % here), so 1 %; selective and full AC are counted exactly (tolerance 0). For no AC the
bf16 weight copies SimpleFSDP gathers are subtracted from the measurement: the planner counts
them apart (`saved_weights`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.flux import FLAVORS, FluxTransformer
from planner.flux import block_bytes, flux_activation_bytes, flux_flops_per_token, flux_tokens

B, SIDE, S = 2, 8, 16  # two samples of 16 image (8 x 8 latent) + 16 text tokens


def _measure(depth: int, single: int, ac_mode: str) -> tuple[int, torch.nn.Module]:
    from models.flux.plan import PLAN
    from parallelisms.activation_checkpoint import apply_ac
    from parallelisms.simple_fsdp import data_parallel
    from planner.activations import saved_bytes
    from trainer.tasks.flow import flow_loss

    args = dataclasses.replace(FLAVORS["debugmodel"], depth=depth, depth_single_blocks=single)
    with torch.device("meta"):
        model = FluxTransformer(args)
    apply_ac(model, plan=PLAN, mode=ac_mode)
    data_parallel(model, mesh=None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, 16, SIDE, SIDE, generator=g)
    t5, clip = torch.randn(B, S, 64, generator=g), torch.randn(B, 64, generator=g)
    noise, t = torch.randn_like(x0), torch.rand(B, generator=g)
    return saved_bytes(
        model, lambda: flow_loss(model, x0, t5, clip, noise, t, torch.ones(B), guidance=None, dtype=torch.bfloat16)
    ), model


@pytest.mark.parametrize("ac_mode", ["none", "selective", "full"])
def test_block_activation_bytes_match_a_real_forward(ac_mode):
    base, model = _measure(1, 1, ac_mode)
    more_double, _ = _measure(2, 1, ac_mode)
    more_single, _ = _measure(1, 2, ac_mode)
    measured = {False: more_double - base, True: more_single - base}
    args = model.args
    tokens = B * ((SIDE // 2) ** 2 + S)
    for single, got in measured.items():
        if ac_mode == "none":
            stack = model.single_blocks if single else model.double_blocks
            got -= 2 * sum(p.numel() for p in stack["0"].parameters())
        want = block_bytes(args, tokens=tokens, samples=B, tp=1, ac_mode=ac_mode, single=single)
        tol = 0.01 if ac_mode == "none" else 0.0
        assert abs(got - want) <= tol * want, (single, got, want)
    acts = flux_activation_bytes(
        args, img_tokens=(SIDE // 2) ** 2, txt_tokens=S, local_batch_size=B, tp=1, ac_mode=ac_mode
    )
    assert acts.blocks == sum(
        block_bytes(args, tokens=tokens, samples=B, tp=1, ac_mode=ac_mode, single=s) for s in (False, True)
    )  # one block of each kind


def test_tensor_parallel_splits_heads_and_mlp_not_the_stream():
    args = FLAVORS["flux-dev"]
    one = block_bytes(args, tokens=1, samples=0, tp=1, ac_mode="none", single=False)
    two = block_bytes(args, tokens=1, samples=0, tp=2, ac_mode="none", single=False)
    d = args.hidden_size
    assert two == 16 * d + 22 * d // 2 + 12 * args.num_heads // 2 + 4 * args.mlp_hidden_dim // 2 + 8
    assert one - two == 22 * d // 2 + 6 * args.num_heads + 2 * args.mlp_hidden_dim
    assert block_bytes(args, tokens=1, samples=0, tp=2, ac_mode="full", single=True) == 2 * d


def test_flops_per_token_is_the_models_count():
    from models.flux.flops import flops_per_sample

    args = FLAVORS["flux-dev"]
    assert flux_flops_per_token(args, img_tokens=4096, txt_tokens=512) * 4608 == pytest.approx(
        flops_per_sample(args, 4096, 512)
    )


def test_estimate_prints_a_flux_plan(capsys):
    """scripts/estimate.py on the FLUX.1-dev pod recipe: the real 12B shape sharded on a fake
    256-device world (FSDP 128 x TP 2), the per-device table and the samples/s line. The fp32
    parameter shard per device lies between num_params x 4 B / 256 (all TP-split) and / 128
    (none TP-split): the adaLN modulation linears and the embedders are TP-replicated."""
    from scripts.estimate import main

    code = main(["--config", "configs/flux_dev_v7x.toml", "--target", "v7x-256"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "flux flux-dev on v7x-256" in out and "dp_shard 256 x tp 1, AC full, local batch 4 x seq 4608" in out
    assert "FLUX: 4096 image + 512 text tokens per sample; 4.00 samples/device/step, global batch 1,024" in out
    state = [line for line in out.splitlines() if "parameters (fp32 master shards)" in line][0]
    gib = float(state.split()[-2])
    total = FLAVORS["flux-dev"].num_params() * 4 / 2**30
    # FSDP over all 256 devices: each holds 1/256 of the fp32 master weights (2-digit print)
    assert gib == pytest.approx(total / 256, abs=0.006), (gib, total)


def test_flux_recipe_without_sample_shape_is_a_config_error(tmp_path, capsys):
    from scripts.estimate import main

    recipe = tmp_path / "flux.toml"
    recipe.write_text('[model]\nname = "flux"\nflavor = "flux-schnell"\n')
    assert main(["--config", str(recipe), "--target", "v6e-256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: flow.latent_size / flow.text_seq_len") and len(err.strip().splitlines()) == 1
    from models.errors import ConfigError
    from trainer.config import FlowConfig

    with pytest.raises(ConfigError, match="flow.latent_size: 5; allowed: an even latent side"):
        flux_tokens(FlowConfig(latent_size=5, text_seq_len=8))
    assert flux_tokens(FlowConfig(latent_size=128, text_seq_len=512)) == (4096, 512)
