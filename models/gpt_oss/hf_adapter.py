"""Hugging Face interop for gpt-oss: `GptOssForCausalLM` (transformers' in-memory names and layout).

Renames, plus three reshapes:
- `self_attn.sinks` [H] <-> `attention.sinks.weight` [H, 1];
- `mlp.experts.gate_up_proj` [E, dim, 2 hidden], gate and up columns interleaved (gate 0, up 0,
  gate 1, ...), and its bias [E, 2 hidden] <-> `moe.experts.w1` / `w3` [E, hidden, dim] (transposed)
  and `b1` / `b3` [E, hidden];
- `mlp.experts.down_proj` [E, hidden, dim] <-> `moe.experts.w2` [E, dim, hidden] (transposed).
A transpose and a stride-2 split are not boxes of the HF tensors, so there is no `hf_layout`: every
rank reads all HF weights and converts them with `from_hf` (docs/checkpointing.md).
The published checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`); `from_hf` takes the
dequantized bf16/fp32 tensors (what transformers holds after loading them, or a BF16 copy).
"""

import re
from typing import Any

import torch

from models.gpt_oss.args import GptOssArgs

_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
# HF key after "model.layers.N." -> ours after "layers.N." (renames only).
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{t}": f"attention.w{p}.{t}" for p in "qkvo" for t in ("weight", "bias")},
    "mlp.router.weight": "moe.router.gate.weight",
    "mlp.router.bias": "moe.router.gate.bias",
    "mlp.experts.down_proj_bias": "moe.experts.b2",
}
_LAYER_INV = {ours: hf for hf, ours in _LAYER.items()}
# Reshaped: HF key after "model.layers.N." -> the ours it makes.
_RESHAPED = {
    "self_attn.sinks": ("attention.sinks.weight",),
    "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.gate_up_proj_bias": ("moe.experts.b1", "moe.experts.b3"),
    "mlp.experts.down_proj": ("moe.experts.w2",),
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _allowed_layer_keys() -> str:
    return ", ".join(sorted([*_LAYER, *_RESHAPED]))


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """HF gpt-oss state dict -> ours (new contiguous tensors for the reshaped ones, renames as given).
    ValueError naming the key for an unknown, quantized (MXFP4) or missing tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer; we rebuild the RoPE tables
        if key == "lm_head.weight":
            if not args.tie_embeddings:
                out["output.weight"] = value
            continue
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(
                f"{key}: unknown Hugging Face parameter; allowed: {sorted(_TOP)}, lm_head.weight, model.layers.N.*"
            )
        layer, rest = match.group(1), match.group(2)
        prefix = f"layers.{layer}."
        if rest.endswith(("_blocks", "_scales")):
            raise ValueError(
                f"{key}: MXFP4-quantized experts; allowed: dequantized tensors (load the checkpoint with "
                "transformers, which dequantizes on the CPU, or use a BF16 copy)"
            )
        if rest in _LAYER:
            out[prefix + _LAYER[rest]] = value
        elif rest == "self_attn.sinks":
            out[prefix + "attention.sinks.weight"] = value.reshape(-1, 1).clone()
        elif rest == "mlp.experts.gate_up_proj":  # [E, dim, 2h] -> w1, w3 [E, h, dim]
            out[prefix + "moe.experts.w1"] = value[..., ::2].transpose(1, 2).contiguous()
            out[prefix + "moe.experts.w3"] = value[..., 1::2].transpose(1, 2).contiguous()
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[prefix + "moe.experts.b1"] = value[:, ::2].contiguous()
            out[prefix + "moe.experts.b3"] = value[:, 1::2].contiguous()
        elif rest == "mlp.experts.down_proj":  # [E, h, dim] -> [E, dim, h]
            out[prefix + "moe.experts.w2"] = value.transpose(1, 2).contiguous()
        else:
            raise ValueError(
                f"{key}: unknown Hugging Face parameter in layer {layer}; allowed: {_allowed_layer_keys()}"
            )
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    missing = sorted(set(_expected_keys(args)) - set(out))
    if missing:
        raise ValueError(
            f"{missing[0]}: missing from the Hugging Face state dict; allowed: a complete gpt-oss state dict"
        )
    return out


def _expected_keys(args: GptOssArgs) -> list[str]:
    layer = [*_LAYER.values(), *(k for keys in _RESHAPED.values() for k in keys)]
    return ["tok_embeddings.weight", "norm.weight", "output.weight"] + [
        f"layers.{i}.{k}" for i in range(args.n_layers) for k in layer
    ]


def to_hf(state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF gpt-oss (`GptOssForCausalLM`'s names and layout; no lm_head when tied)."""
    out: dict[str, torch.Tensor] = {}
    top_inv = {ours: hf for hf, ours in _TOP.items()}
    for key, value in state_dict.items():
        if key == "output.weight":
            if not args.tie_embeddings:
                out["lm_head.weight"] = value
            continue
        if key in top_inv:
            out[top_inv[key]] = value
            continue
        match = _OURS_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of the gpt_oss model")
        layer, rest = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _LAYER_INV:
            out[prefix + _LAYER_INV[rest]] = value
        elif rest == "attention.sinks.weight":
            out[prefix + "self_attn.sinks"] = value.reshape(-1).clone()
        elif rest == "moe.experts.w1":  # interleave gate and up columns: [E, dim, h, 2] -> [E, dim, 2h]
            w3 = state_dict[f"layers.{layer}.moe.experts.w3"]
            out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
                [value.transpose(1, 2), w3.transpose(1, 2)], dim=-1
            ).flatten(-2)
        elif rest == "moe.experts.b1":
            b3 = state_dict[f"layers.{layer}.moe.experts.b3"]
            out[prefix + "mlp.experts.gate_up_proj_bias"] = torch.stack([value, b3], dim=-1).flatten(-2)
        elif rest == "moe.experts.w2":
            out[prefix + "mlp.experts.down_proj"] = value.transpose(1, 2).contiguous()
        elif rest in ("moe.experts.w3", "moe.experts.b3"):
            continue  # written with w1 / b1
        else:
            raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of the gpt_oss model")
    return out


def hf_config(args: GptOssArgs) -> dict[str, Any]:
    """A `config.json` dict for `GptOssForCausalLM` (transformers 5 `rope_parameters`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor != 1.0:
        rope = {
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.rope_factor,
            "beta_fast": args.rope_beta_fast,
            "beta_slow": args.rope_beta_slow,
            "truncate": False,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
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
        rope_factor=float(params["factor"]) if yarn else 1.0,
        rope_beta_fast=float(params.get("beta_fast") or 32.0) if yarn else 32.0,
        rope_beta_slow=float(params.get("beta_slow") or 1.0) if yarn else 1.0,
        rope_original_max_seq_len=int(params.get("original_max_position_embeddings", 4096)) if yarn else 4096,
        max_seq_len=cfg.get("max_position_embeddings", 131072),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=cfg.get("num_local_experts", cfg.get("num_experts")),
        num_experts_per_tok=cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
        moe_hidden_dim=cfg["intermediate_size"],
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
