"""diffusers interop for FLUX: `FluxTransformer2DModel` state dicts and `config.json`.

Our names follow BFL/TorchTitan with q/k/v split; diffusers' follow its own modules. All
entries are renames except two:
- a single block's `proj_out` ([hidden, hidden + mlp_hidden], input [attn; mlp]) is our
  `attn.wo` (its first `hidden` input columns, with the bias) plus `mlp.w2` (the rest);
- the final layer's modulation: ours is BFL's (shift, scale) order, diffusers'
  `norm_out.linear` is (scale, shift), so the two halves of its rows swap.

Both directions accept a subset of the keys (scripts/convert.py converts one block at a
time), provided a single block's `attn.wo.weight` and `mlp.w2.weight` come together.
`hf_layout` states the diffusers -> ours direction as boxes of diffusers tensors (both
exceptions are copies of boxes: a column range of `proj_out`, the two row halves of
`norm_out.linear` in swapped places), so a rank reads only the slices it owns; `from_hf` is
that layout applied to an in-memory state dict.
"""

from __future__ import annotations

from typing import Any

import torch

from models.common.hf_adapter import HFEntry, HFLayout, HFPiece, apply_layout, whole
from models.flux.args import FluxArgs

CLASS_NAME = "FluxTransformer2DModel"
WEIGHTS_NAME = "diffusion_pytorch_model"
"""Base name of the safetensors files diffusers' `from_pretrained` reads."""

_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.wq": "attn.to_q",
    "img_attn.wk": "attn.to_k",
    "img_attn.wv": "attn.to_v",
    "img_attn.q_norm": "attn.norm_q",
    "img_attn.k_norm": "attn.norm_k",
    "img_attn.wo": "attn.to_out.0",
    "txt_attn.wq": "attn.add_q_proj",
    "txt_attn.wk": "attn.add_k_proj",
    "txt_attn.wv": "attn.add_v_proj",
    "txt_attn.q_norm": "attn.norm_added_q",
    "txt_attn.k_norm": "attn.norm_added_k",
    "txt_attn.wo": "attn.to_add_out",
    "img_mlp.w1": "ff.net.0.proj",
    "img_mlp.w2": "ff.net.2",
    "txt_mlp.w1": "ff_context.net.0.proj",
    "txt_mlp.w2": "ff_context.net.2",
}
_SINGLE = {
    "modulation.lin": "norm.linear",
    "attn.wq": "attn.to_q",
    "attn.wk": "attn.to_k",
    "attn.wv": "attn.to_v",
    "attn.q_norm": "attn.norm_q",
    "attn.k_norm": "attn.norm_k",
    "mlp.w1": "proj_mlp",
}
_FINAL_MOD = ("final_layer.modulation.lin", "norm_out.linear")


def _renames(args: FluxArgs) -> dict[str, str]:
    """Our parameter name -> diffusers name, for every 1:1 entry."""
    modules = dict(_TOP)
    for i in range(args.depth):
        modules.update({f"double_blocks.{i}.{k}": f"transformer_blocks.{i}.{v}" for k, v in _DOUBLE.items()})
    for i in range(args.depth_single_blocks):
        modules.update({f"single_blocks.{i}.{k}": f"single_transformer_blocks.{i}.{v}" for k, v in _SINGLE.items()})
    return {f"{k}.{p}": f"{v}.{p}" for k, v in modules.items() for p in ("weight", "bias")}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _swapped_halves(key: str, shape: tuple[int, ...]) -> HFEntry:
    """Ours is the HF tensor with the two halves of dim 0 exchanged (inverse of `_swap_halves`)."""
    n = shape[0] // 2
    zero = (0,) * (len(shape) - 1)
    half = (n, *shape[1:])
    return HFEntry(shape, (HFPiece(key, (0, *zero), half, (n, *zero)), HFPiece(key, (n, *zero), half, (0, *zero))))


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: FluxArgs) -> HFLayout:
    """diffusers names and shapes -> how each of our parameters is made of them; ValueError on a
    key it does not know."""
    inverse = {v: k for k, v in _renames(args).items()}
    out: HFLayout = {}
    for key, shape in hf_shapes.items():
        shape = tuple(shape)
        if key in inverse:
            out[inverse[key]] = whole(key, shape)
        elif key.startswith(_FINAL_MOD[1] + "."):
            if shape[0] % 2:
                raise ValueError(
                    f"{key}: odd number of rows {shape[0]}; allowed: an even number ((scale, shift) halves)"
                )
            out[_FINAL_MOD[0] + key[len(_FINAL_MOD[1]) :]] = _swapped_halves(key, shape)
        elif key.startswith("single_transformer_blocks.") and key.endswith(".proj_out.weight"):
            i, h = key.split(".")[1], args.hidden_size
            if len(shape) != 2 or shape[1] <= h:
                raise ValueError(f"{key}: shape {list(shape)}; allowed: [{h}, {h} + mlp hidden]")
            attn, mlp = (shape[0], h), (shape[0], shape[1] - h)
            out[f"single_blocks.{i}.attn.wo.weight"] = HFEntry(attn, (HFPiece(key, (0, 0), attn, (0, 0)),))
            out[f"single_blocks.{i}.mlp.w2.weight"] = HFEntry(mlp, (HFPiece(key, (0, 0), mlp, (0, h)),))
        elif key.startswith("single_transformer_blocks.") and key.endswith(".proj_out.bias"):
            out[f"single_blocks.{key.split('.')[1]}.attn.wo.bias"] = whole(key, shape)
        else:
            raise ValueError(
                f"{key}: not a parameter of {CLASS_NAME} with this config; allowed: the parameters of {CLASS_NAME} "
                "with the config's sizes"
            )
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
    """diffusers `FluxTransformer2DModel` state dict -> ours; ValueError on a key it does not know."""
    return apply_layout(hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args), hf_state_dict)


def to_hf(state_dict: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> diffusers `FluxTransformer2DModel` state dict."""
    renames = _renames(args)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in renames:
            out[renames[key]] = value
        elif key.startswith(_FINAL_MOD[0] + "."):
            out[_FINAL_MOD[1] + key[len(_FINAL_MOD[0]) :]] = _swap_halves(value)
        elif key.startswith("single_blocks.") and key.endswith(".attn.wo.weight"):
            i = key.split(".")[1]
            mlp_key = f"single_blocks.{i}.mlp.w2.weight"
            if mlp_key not in state_dict:
                raise ValueError(
                    f"{mlp_key}: needed with {key} (they form one proj_out); allowed: a state dict with both"
                )
            out[f"single_transformer_blocks.{i}.proj_out.weight"] = torch.cat([value, state_dict[mlp_key]], dim=1)
        elif key.startswith("single_blocks.") and key.endswith(".attn.wo.bias"):
            out[f"single_transformer_blocks.{key.split('.')[1]}.proj_out.bias"] = value
        elif key.startswith("single_blocks.") and key.endswith(".mlp.w2.weight"):
            continue  # joined into proj_out with attn.wo.weight
        else:
            raise ValueError(f"{key}: not a parameter of FluxTransformer with these args; allowed: its parameters")
    return out


def hf_config(args: FluxArgs) -> dict[str, Any]:
    """A diffusers `config.json` dict for `FluxTransformer2DModel`; ValueError for args it cannot
    express (diffusers fixes mlp_ratio 4, q/k/v biases and RoPE theta 10000)."""
    for name, fixed in (("mlp_ratio", 4.0), ("qkv_bias", True), ("theta", 10000)):
        if getattr(args, name) != fixed:
            raise ValueError(f"model.{name}: {getattr(args, name)} has no diffusers equivalent; allowed: {fixed}")
    return {
        "_class_name": CLASS_NAME,
        "patch_size": 1,
        "in_channels": args.in_channels,
        "out_channels": args.out_channels,
        "num_layers": args.depth,
        "num_single_layers": args.depth_single_blocks,
        "attention_head_dim": args.head_dim,
        "num_attention_heads": args.num_heads,
        "joint_attention_dim": args.context_in_dim,
        "pooled_projection_dim": args.vec_in_dim,
        "guidance_embeds": args.guidance_embed,
        "axes_dims_rope": list(args.axes_dim),
    }


def args_from_hf_config(cfg: dict[str, Any]) -> FluxArgs:
    """`FluxArgs` from a diffusers `FluxTransformer2DModel` config dict; ValueError otherwise."""
    if cfg.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(f"_class_name: {cfg['_class_name']!r} unsupported; allowed: {CLASS_NAME!r}")
    if cfg.get("patch_size", 1) != 1:
        raise ValueError(f"patch_size: {cfg['patch_size']} unsupported; allowed: 1 (2x2 packing happens outside)")
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    in_channels = cfg.get("in_channels", 64)
    return FluxArgs(
        in_channels=in_channels,
        out_channels=cfg.get("out_channels") or in_channels,
        vec_in_dim=cfg.get("pooled_projection_dim", 768),
        context_in_dim=cfg.get("joint_attention_dim", 4096),
        hidden_size=heads * head_dim,
        num_heads=heads,
        depth=cfg.get("num_layers", 19),
        depth_single_blocks=cfg.get("num_single_layers", 38),
        axes_dim=tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
        guidance_embed=bool(cfg.get("guidance_embeds", False)),
    )
