"""gpt-oss's MXFP4 hub checkpoints (trainer/checkpoint/hf_mxfp4.py): read dequantized by the
per-rank loader and by `convert.py from-hf`.

The reference is transformers' own reader of the format (`integrations.mxfp4.
convert_moe_packed_tensors`, what `from_pretrained(..., dequantize)` runs): every value of the
format is exact in bfloat16, so ours must equal it bit for bit, and so must every box a rank
could read and the weights a model loads (random codes and exponents, not made by a quantizer).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from models.errors import ConfigError
from models.gpt_oss import FLAVORS, GptOssTransformer
from models.gpt_oss import hf_adapter as gpt_oss_hf
from trainer import checkpoint as ckpt
from trainer.checkpoint.hf_mxfp4 import dequantize

ARGS = dataclasses.replace(
    FLAVORS["debugmodel"],
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=160,
    sliding_window=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_hidden_dim=64,
    max_seq_len=64,
)
EXPERTS = ("gate_up_proj", "down_proj")


def _theirs(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


def _packed(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and exponents for a transformers tensor [E, in, out]: blocks [E, out,
    in / 32, 16], scales [E, out, in / 32] around 2^0 (every code, both nibbles)."""
    e, n_in, n_out = shape
    blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (e, n_out, n_in // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A gpt-oss hub folder of ARGS: bf16 tensors, the experts MXFP4 (config.json's
    quantization_config as the hub's); returns (folder, the dequantized HF state dict)."""
    gen = torch.Generator().manual_seed(3)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in gpt_oss_hf.to_hf(GptOssTransformer(ARGS).state_dict(), ARGS).items()}
    stored, reference = {}, {}
    for key, shape in shapes.items():
        if key.rsplit(".", 1)[-1] in EXPERTS:
            blocks, scales = _packed(shape, gen)
            stored[key + "_blocks"], stored[key + "_scales"] = blocks, scales
            reference[key] = _theirs(blocks, scales)
            assert reference[key].shape == shape
        else:
            stored[key] = reference[key] = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("mxfp4") / "hf"
    path.mkdir()
    config = {**gpt_oss_hf.hf_config(ARGS), "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, reference


def test_dequantize_equals_transformers_reader():
    """Every code in both nibbles and exponents from 2^-7 to 2^3, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (3, 40, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize(blocks, scales)
    assert ours.shape == (3, 128, 40) and ours.dtype == torch.bfloat16
    assert torch.equal(ours, _theirs(blocks, scales))


def test_the_folder_loads_and_converts_dequantized(folder, tmp_path):
    """The per-rank loader (gpt-oss's `hf_layout`, box reads) and `convert.py from-hf` give the
    dequantized weights exactly; every box a rank could read equals the reference's box."""
    path, reference = folder
    want = gpt_oss_hf.from_hf(reference, ARGS)
    model = GptOssTransformer(ARGS)
    model.init_weights()
    ckpt.load_initial(model, path=path, fmt="hf", hf_adapter=gpt_oss_hf, args=ARGS)
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name].to(value.dtype)), name

    reader = ckpt.SafetensorsSlices(ckpt.safetensors_files(path))
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [4, 64, 128]: 2 blocks of 32 along in
    assert not any(k.endswith(("_blocks", "_scales")) for k in reader.shapes())
    assert reader.shapes()[name] == (4, 64, 128) and reader.dtype(name) == torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    for _ in range(12):
        lo = [int(torch.randint(0, n, (1,), generator=gen)) for n in (4, 64, 128)]
        hi = [int(torch.randint(a + 1, n + 1, (1,), generator=gen)) for a, n in zip(lo, (4, 64, 128))]
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        assert torch.equal(reader.read(name, box), reference[name][box]), box

    from scripts import convert

    assert convert.main(["from-hf", str(path), str(tmp_path / "dcp")]) == 0
    loaded = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in want.items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(v, want[k]) for k, v in loaded.items())


def test_a_block_without_its_scales_is_one_error(tmp_path):
    gen = torch.Generator().manual_seed(4)
    blocks, scales = _packed((2, 64, 32), gen)
    save_file({"x_blocks": blocks}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"x_blocks is MXFP4 but x_scales is missing; allowed: "):
        ckpt.SafetensorsSlices([tmp_path / "model.safetensors"])
    save_file({"x_blocks": blocks, "x_scales": scales[:, :, :0]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"x_scales is uint8 \[2, 32, 0\] for x_blocks .*allowed: uint8 \[2, 32, 2\]"):
        ckpt.SafetensorsSlices([tmp_path / "model.safetensors"])
