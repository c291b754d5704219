"""Hugging Face interop for Qwen 3.5: `Qwen3_5ForCausalLM` (dense) and `Qwen3_5MoeForCausalLM` (MoE).

Every tensor is a rename (our modules keep HF's layouts: the full attention's `q_proj` with each
head's [query | gate] rows, the Gated DeltaNet's fused `in_proj_qkv` and `conv1d` [C, 1, K]), plus
the experts, stacked per expert (hub layout `mlp.experts.J.{gate,up,down}_proj.weight`) or fused
(transformers 5's in-memory `mlp.experts.gate_up_proj` / `down_proj`), as Qwen 3 MoE. The hub
checkpoints are the multimodal `Qwen3_5ForConditionalGeneration`: their language model's keys
`model.language_model.*` are read as `model.*`, and the vision tower (`model.visual.*`) is skipped.
Their multi-token-prediction module (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`,
`mtp.layers.J.*` with a main block's names) is ours under the same names (`mtp.layers.J.*` as a
main block's) when `mtp_depth` is 1, and skipped when it is 0 (transformers loads none of it).
"""

from typing import Any

import torch

from models.common.hf_adapter import (
    DecoderNames,
    HFLayout,
    apply_layout,
    decoder_hf_layout,
    decoder_to_hf,
    whole,
)
from models.qwen3_5.args import Qwen3_5Args

_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
_LINEAR = (
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)
# HF key after "model.layers.N." -> ours after "layers.N.".
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.weight": f"attention.w{p}.weight" for p in "qkvo"},
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    **{f"linear_attn.{name}": f"attention.{name}" for name in _LINEAR},
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.shared_expert.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_expert.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_expert.down_proj.weight": "moe.shared_experts.w2.weight",
    "mlp.shared_expert_gate.weight": "moe.shared_gate.weight",
}


def _text_key(key: str) -> str:
    """The multimodal checkpoint's language-model key as the causal LM's."""
    return "model." + key[len("model.language_model.") :] if key.startswith("model.language_model.") else key


NAMES = DecoderNames(family="a Qwen 3.5", top=_TOP, layer=_LAYER, hf_name=_text_key, skip=("model.visual.", "mtp."))


MTP_TOP = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
"""The MTP module's own tensors, after `mtp.` in both name sets (its blocks are `mtp.layers.J.*`)."""
MTP_NAMES = DecoderNames(family="a Qwen 3.5", top={}, layer=_LAYER, hf_name=lambda key: "model." + key[len("mtp.") :])
"""The MTP blocks' names: `mtp.layers.J.<HF block name>` read as a main block J's."""


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: Qwen3_5Args) -> HFLayout:
    """HF names and shapes -> how each of our parameters is made of them (models/common/hf_adapter.py).
    ValueError naming the key for an unknown or missing tensor."""
    mtp = args.mtp_depth > 0
    out = decoder_hf_layout(
        {k: s for k, s in hf_shapes.items() if not (mtp and k.startswith("mtp."))},
        tie_embeddings=args.tie_embeddings,
        num_experts=args.num_experts,
        names=NAMES,
        expected=[k for k in _expected_keys(args) if not k.startswith("mtp.")],
    )
    if mtp:
        blocks = {k: s for k, s in hf_shapes.items() if k.startswith("mtp.layers.")}
        layout = decoder_hf_layout(
            blocks, tie_embeddings=False, num_experts=args.num_experts, names=MTP_NAMES, expected=[]
        )
        out.update({f"mtp.{k}": entry for k, entry in layout.items()})
        for name in MTP_TOP:
            if f"mtp.{name}" in hf_shapes:
                out[f"mtp.{name}"] = whole(f"mtp.{name}", hf_shapes[f"mtp.{name}"])
        unknown = sorted(k for k in hf_shapes if k.startswith("mtp.") and not k.startswith("mtp.layers."))
        unknown = [k for k in unknown if k[len("mtp.") :] not in MTP_TOP]
        if unknown:
            raise ValueError(
                f"{unknown[0]}: unknown Hugging Face parameter of the MTP module; allowed: "
                f"{', '.join('mtp.' + n for n in MTP_TOP)}, mtp.layers.J.*"
            )
        missing = sorted(set(_expected_keys(args)) - set(out))
        if missing:
            raise ValueError(
                f"{missing[0]}: missing from the Hugging Face state dict (mtp_depth = 1 reads the MTP module); "
                "allowed: a checkpoint with its mtp.* tensors, or model.mtp_depth = 0"
            )
    return out


def _expected_keys(args: Qwen3_5Args) -> list[str]:
    full = [f"attention.{n}" for n in ("wq.weight", "wk.weight", "wv.weight", "wo.weight")]
    full += ["attention.q_norm.weight", "attention.k_norm.weight"]
    linear = [f"attention.{name}" for name in _LINEAR]
    if args.is_moe:
        mlp = ["moe.router.gate.weight", "moe.shared_gate.weight"]
        mlp += [f"moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
        mlp += [f"moe.experts.{w}" for w in ("w1", "w2", "w3")]
    else:
        mlp = [f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
    norms = ["attention_norm.weight", "ffn_norm.weight"]
    keys = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(args.n_layers):
        keys += [f"layers.{i}.{k}" for k in [*norms, *(full if args.is_full_attention(i) else linear), *mlp]]
    if args.mtp_depth:  # the MTP module: its own tensors, then full-attention blocks
        keys += [f"mtp.{name}" for name in MTP_TOP]
        keys += [f"mtp.layers.{j}.{k}" for j in range(args.mtp_layers) for k in [*norms, *full, *mlp]]
    return keys


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3_5Args) -> dict[str, torch.Tensor]:
    """HF Qwen 3.5 state dict (causal LM, or the multimodal checkpoint's language model) -> ours."""
    layout = hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args)
    return apply_layout(layout, hf_state_dict)


def to_hf(
    state_dict: dict[str, torch.Tensor], args: Qwen3_5Args, *, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `Qwen3_5(Moe)ForCausalLM` names (no lm_head when tied); experts per
    expert (hub layout) unless `fused_experts` (transformers 5's in-memory modules)."""
    main = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    out = decoder_to_hf(main, tie_embeddings=args.tie_embeddings, fused_experts=fused_experts, names=NAMES)
    blocks = {k[len("mtp.") :]: v for k, v in state_dict.items() if k.startswith("mtp.layers.")}
    for key, value in decoder_to_hf(blocks, tie_embeddings=True, fused_experts=fused_experts, names=NAMES).items():
        out["mtp." + key[len("model.") :]] = value
    out.update({k: v for k, v in state_dict.items() if k.startswith("mtp.") and k[len("mtp.") :] in MTP_TOP})
    return out


def hf_config(args: Qwen3_5Args) -> dict[str, Any]:
    """A `config.json` dict for `Qwen3_5ForCausalLM`, or `Qwen3_5MoeForCausalLM` when `num_experts > 0`
    (the text model's config; transformers 5 `rope_parameters`)."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM" if args.is_moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if args.is_moe else "qwen3_5_text",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": args.layer_types(),
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "initializer_range": 0.02,
        "use_cache": True,
        "mtp_num_hidden_layers": args.mtp_layers,
    }
    if args.is_moe:
        cfg.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_hidden_dim,
            shared_expert_intermediate_size=args.shared_expert_hidden_dim,
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    else:
        cfg["intermediate_size"] = args.hidden_dim
    return cfg


def args_from_hf_config(cfg: dict[str, Any]) -> Qwen3_5Args:
    """`Qwen3_5Args` from a Qwen 3.5 `config.json` (the text config, or a multimodal one's
    `text_config`); ValueError naming the key for what this family cannot run."""
    if "text_config" in cfg and cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        cfg = cfg["text_config"]
    model_type = cfg.get("model_type")
    allowed_types = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    if model_type not in allowed_types:
        raise ValueError(f"model_type: {model_type!r} unsupported; allowed: {', '.join(map(repr, allowed_types))}")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias: biases are not supported; allowed: false")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {cfg['hidden_act']!r} unsupported; allowed: 'silu'")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ValueError(f"rope_parameters.rope_type: {params.get('rope_type')!r} unsupported; allowed: 'default'")
    n_layers = cfg["num_hidden_layers"]
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types")
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if types is not None and list(types) != expected:
        raise ValueError(
            f"layer_types: only a full-attention block every {interval}th (the others linear_attention) is "
            f"supported; allowed: {expected[:interval]} repeated"
        )
    moe = cfg.get("num_experts", 0) > 0 and "moe" in model_type
    extra = (
        dict(
            num_experts=cfg["num_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_hidden_dim=cfg["moe_intermediate_size"],
            shared_expert_hidden_dim=cfg["shared_expert_intermediate_size"],
        )
        if moe
        else dict(hidden_dim=cfg["intermediate_size"])
    )
    return Qwen3_5Args(
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        full_attention_interval=interval,
        linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
        linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
        linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
        linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 1),
        **extra,
    )
