"""Hugging Face interop for gpt-oss: `GptOssForCausalLM` (transformers' in-memory names and layout).

Our experts hold transformers' tensors as they are (`moe.experts.gate_up_proj` [E, dim, 2 hidden]
with gate and up columns interleaved, `gate_up_proj_bias`, `down_proj` [E, hidden, dim],
`down_proj_bias`), so every tensor is a rename but one: `self_attn.sinks` [H] <->
`attention.sinks.weight` [H, 1] (the sinks are a linear's weight, models/gpt_oss/model.py), one box
per head. `hf_layout` says so from names and shapes, so HF weights load per rank reading only each
rank's slices, and `scripts/convert.py from-hf` converts one tensor at a time.
The published checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`): the checkpoint
reader dequantizes them (trainer/checkpoint/hf_mxfp4.py) before this layout sees them, so the
loader and `convert.py from-hf` read the hub folders; an in-memory state dict that still holds
them is refused by name.
"""

from typing import Any

import torch

from models.common.hf_adapter import (
    DecoderNames,
    HFEntry,
    HFLayout,
    HFPiece,
    apply_layout,
    decoder_hf_layout,
    decoder_to_hf,
)
from models.gpt_oss.args import GptOssArgs

_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
# HF key after "model.layers.N." -> ours after "layers.N." (renames).
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{t}": f"attention.w{p}.{t}" for p in "qkvo" for t in ("weight", "bias")},
    "mlp.router.weight": "moe.router.gate.weight",
    "mlp.router.bias": "moe.router.gate.bias",
    **{
        f"mlp.experts.{n}": f"moe.experts.{n}"
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    },
}
_SINKS, _OURS_SINKS = "self_attn.sinks", "attention.sinks.weight"


def _layer_extra(key: str, shape: tuple[int, ...], rest: str) -> tuple[str, HFEntry] | None:
    """The sinks [H] -> [H, 1] (head h is our box (h, 0) of shape (1, 1)); MXFP4 experts refused."""
    if rest.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"{key}: MXFP4-quantized experts; allowed: dequantized tensors (load the folder with "
            "checkpoint.initial_load_path or scripts/convert.py from-hf, which dequantize, or with transformers)"
        )
    if rest != _SINKS:
        return None
    return _OURS_SINKS, HFEntry((shape[0], 1), tuple(HFPiece(key, (h, 0), (1, 1), (h,)) for h in range(shape[0])))


def _extra_to_hf(rest: str, value: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    return (_SINKS, value.reshape(-1).clone()) if rest == _OURS_SINKS else None


NAMES = DecoderNames(family="a gpt-oss", top=_TOP, layer=_LAYER, layer_extra=_layer_extra, extra_to_hf=_extra_to_hf)


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: GptOssArgs) -> HFLayout:
    """HF names and shapes -> how each of our parameters is made of them (models/common/hf_adapter.py).
    ValueError naming the key for an unknown, quantized (MXFP4) or missing tensor."""
    return decoder_hf_layout(hf_shapes, tie_embeddings=args.tie_embeddings, names=NAMES, expected=_expected_keys(args))


def _expected_keys(args: GptOssArgs) -> list[str]:
    layer = [*_LAYER.values(), _OURS_SINKS]
    return ["tok_embeddings.weight", "norm.weight", "output.weight"] + [
        f"layers.{i}.{k}" for i in range(args.n_layers) for k in layer
    ]


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """HF gpt-oss state dict -> ours (`hf_layout` applied: renames are views of the given tensors)."""
    layout = hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args)
    return apply_layout(layout, hf_state_dict)


def to_hf(state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF gpt-oss (`GptOssForCausalLM`'s names and layout; no lm_head when tied)."""
    return decoder_to_hf(state_dict, tie_embeddings=args.tie_embeddings, names=NAMES)


def hf_config(args: GptOssArgs) -> dict[str, Any]:
    """A `config.json` dict for `GptOssForCausalLM` (transformers 5 `rope_parameters`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor != 1.0:
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, **args.yarn_hf(), "truncate": False}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "sliding_window": args.sliding_window,
        "layer_types": [
            "sliding_attention" if args.layer_window(i) else "full_attention" for i in range(args.n_layers)
        ],
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "use_cache": True,
    }


def args_from_hf_config(cfg: dict[str, Any]) -> GptOssArgs:
    """`GptOssArgs` from a gpt-oss `config.json` (hub: rope_theta + rope_scaling; transformers 5:
    rope_parameters); ValueError naming the key for what this family cannot run."""
    if cfg.get("model_type") != "gpt_oss":
        raise ValueError(f"model_type: {cfg.get('model_type')!r} unsupported; allowed: 'gpt_oss'")
    if not cfg.get("attention_bias", True):
        raise ValueError("attention_bias: gpt-oss attention has biases; allowed: true")
    n_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if types is not None and list(types) != alternating:
        raise ValueError(
            "layer_types: only sliding-window and full layers alternating from a sliding one are supported; "
            "allowed: sliding_attention, full_attention, sliding_attention, ..."
        )
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {"rope_type": "default"}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("yarn", "default"):
        raise ValueError(f"rope_parameters.rope_type: {rope_type!r} unsupported; allowed: 'yarn', 'default'")
    if rope_type == "yarn" and params.get("truncate", True):
        raise ValueError("rope_parameters.truncate: gpt-oss's YaRN does not round its ramp; allowed: false")
    if rope_type == "yarn" and (params.get("attention_factor") or params.get("mscale") or params.get("mscale_all_dim")):
        raise ValueError("rope_parameters.attention_factor: only YaRN's default scale is supported; allowed: unset")
    yarn = rope_type == "yarn"
    return GptOssArgs(
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        sliding_window=cfg.get("sliding_window") or 128,
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 150000.0))),
        **GptOssArgs.yarn_from_hf(params if yarn else None),
        max_seq_len=cfg.get("max_position_embeddings", 131072),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=cfg.get("num_local_experts", cfg.get("num_experts")),
        num_experts_per_tok=cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
        moe_hidden_dim=cfg["intermediate_size"],
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
