"""Hugging Face interop for DeepSeek-V4: `DeepseekV4ForCausalLM` (transformers' in-memory names).

Every tensor is a rename (`DecoderNames`) but the routed experts: transformers' fused
`mlp.experts.gate_up_proj` [E, 2 hidden, dim] (gate rows first) is our `moe.experts.w1` and `w3`
(two boxes of it), `down_proj` our `w2` (models/common/hf_adapter.py understands both ways). The
two router buffers are state too: `mlp.gate.e_score_correction_bias` (learned-routing blocks, our
`moe.router.expert_bias`) and `mlp.gate.tid2eid` (hash blocks, our `moe.router.tid2eid`).
`hf_layout` says all of it from names and shapes, so HF weights load per rank reading only each
rank's slices. The DeepSeek release files (original names, FP8/FP4 weights, the MTP block) are what
transformers converts when it loads them; save such a model with transformers first. MTP weights
(`mtp.*`) are skipped, as transformers skips them.
"""

from typing import Any

import torch

from models.common.hf_adapter import DecoderNames, HFLayout, apply_layout, decoder_hf_layout, decoder_to_hf
from models.deepseek_v4.args import ATTENTION_KINDS, DeepSeekV4Args, default_attention_layers

_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head.fn",
    "model.hc_head.hc_base": "hc_head.base",
    "model.hc_head.hc_scale": "hc_head.scale",
}
_POOL = {
    "kv_proj.weight": "wkv.weight",
    "gate_proj.weight": "wgate.weight",
    "position_bias": "position_bias",
    "kv_norm.weight": "norm.weight",
}
# HF key after "model.layers.N." -> ours after "layers.N." (renames).
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hc}.{p}": f"{hc}.{p}" for hc in ("attn_hc", "ffn_hc") for p in ("fn", "base", "scale")},
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_norm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_proj.weight": "attention.wkv.weight",
    "self_attn.kv_norm.weight": "attention.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attention.wo_a.weight",
    "self_attn.o_b_proj.weight": "attention.wo_b.weight",
    "self_attn.sinks": "attention.sinks.weight",
    **{f"self_attn.compressor.{hf}": f"attention.compressor.{ours}" for hf, ours in _POOL.items()},
    **{f"self_attn.compressor.indexer.{hf}": f"attention.indexer.{ours}" for hf, ours in _POOL.items()},
    "self_attn.compressor.indexer.q_b_proj.weight": "attention.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attention.indexer.weights_proj.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "moe.router.expert_bias",
    "mlp.gate.tid2eid": "moe.router.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
}

NAMES = DecoderNames(family="a DeepSeek-V4", top=_TOP, layer=_LAYER, skip=("mtp.", "model.mtp."))


def _expected_keys(args: DeepSeekV4Args) -> list[str]:
    """Our state-dict keys for `args` (the model built on the meta device)."""
    from models.deepseek_v4.model import DeepSeekV4

    with torch.device("meta"):
        return list(DeepSeekV4(args).state_dict())


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: DeepSeekV4Args) -> HFLayout:
    """HF names and shapes -> how each of our parameters and buffers is made of them
    (models/common/hf_adapter.py). ValueError naming the key for an unknown or missing tensor."""
    layout = decoder_hf_layout(
        hf_shapes, tie_embeddings=args.tie_embeddings, names=NAMES, expected=_expected_keys(args)
    )
    expected = set(_expected_keys(args))
    for name in layout:
        if name not in expected:  # e.g. a compressor in a block this flavor has as sliding
            raise ValueError(
                f"{name}: not a tensor of this flavor's model (its attention_layers = {args.layer_kinds()!r}, "
                f"num_hash_layers = {args.num_hash_layers}); allowed: a state dict of this flavor's shape"
            )
    return layout


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: DeepSeekV4Args) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V4 state dict -> ours (renames are views of the given tensors)."""
    layout = hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args)
    return apply_layout(layout, hf_state_dict)


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekV4Args) -> dict[str, torch.Tensor]:
    """Our state dict -> HF (`DeepseekV4ForCausalLM`'s in-memory names, fused experts; no lm_head when tied)."""
    return decoder_to_hf(state_dict, tie_embeddings=args.tie_embeddings, fused_experts=True, names=NAMES)


def hf_config(args: DeepSeekV4Args) -> dict[str, Any]:
    """A `config.json` dict for `DeepseekV4ForCausalLM` (transformers 5)."""
    rope: dict[str, Any] = {"rope_type": "default"}
    if args.rope_factor != 1.0:
        rope = {"rope_type": "yarn", **args.yarn_hf()}
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "partial_rotary_factor": args.rope_head_dim / args.head_dim,
        "q_lora_rank": args.q_lora_rank,
        "o_groups": args.o_groups,
        "o_lora_rank": args.o_lora_rank,
        "num_experts_per_tok": args.num_experts_per_tok,
        "n_routed_experts": args.num_experts,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": args.route_scale,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "compress_rope_theta": args.compress_rope_theta,
        "rope_parameters": rope,
        "layer_types": [ATTENTION_KINDS[k] for k in args.layer_kinds()],
        "compress_rates": {
            "compressed_sparse_attention": args.csa_ratio,
            "heavily_compressed_attention": args.hca_ratio,
        },
        "mlp_layer_types": ["hash_moe" if args.is_hash_layer(i) else "moe" for i in range(args.n_layers)],
        "hc_mult": args.hc_mult,
        "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps,
        "swiglu_limit": args.swiglu_limit,
        "sliding_window": args.sliding_window,
        "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim,
        "index_topk": args.index_topk,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }


def _letters(cfg: dict[str, Any], n_layers: int, csa: int, hca: int) -> str:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = {0: "s", csa: "c", hca: "h"}
        bad = [r for r in cfg["compress_ratios"] if r not in ratios]
        if bad:
            raise ValueError(f"compress_ratios: {bad[0]} is neither 0, {csa} nor {hca}; allowed: 0, {csa}, {hca}")
        return "".join(ratios[r] for r in cfg["compress_ratios"])[:n_layers]
    if types is None:
        return ""
    kinds = {v: k for k, v in ATTENTION_KINDS.items()}
    bad = [t for t in types if t not in kinds]
    if bad:
        raise ValueError(f"layer_types: {bad[0]!r} unsupported; allowed: {', '.join(kinds)}")
    return "".join(kinds[t] for t in types)[:n_layers]


def args_from_hf_config(cfg: dict[str, Any]) -> DeepSeekV4Args:
    """`DeepSeekV4Args` from a DeepSeek-V4 `config.json` (transformers 5 form, nested
    `rope_parameters` {main, compress} or flat, and the legacy keys transformers folds in:
    compress_ratios, compress_rate_csa/hca, num_hash_layers, qk_rope_head_dim); ValueError naming
    the key for what this family cannot run."""
    _check_supported(cfg)
    n_layers = cfg.get("num_hidden_layers", 43)
    rates = dict(cfg.get("compress_rates") or {})
    csa = int(cfg.get("compress_rate_csa") or rates.get("compressed_sparse_attention", 4))
    hca = int(cfg.get("compress_rate_hca") or rates.get("heavily_compressed_attention", 128))
    num_hash = _num_hash_layers(cfg, n_layers)
    head_dim = cfg.get("head_dim", 512)
    letters = _letters(cfg, n_layers, csa, hca)
    rope = _rope_fields(cfg, head_dim)
    return DeepSeekV4Args(
        dim=cfg.get("hidden_size", 4096),
        n_layers=n_layers,
        n_heads=cfg.get("num_attention_heads", 64),
        head_dim=head_dim,
        q_lora_rank=cfg.get("q_lora_rank", 1024),
        o_groups=cfg.get("o_groups", 8),
        o_lora_rank=cfg.get("o_lora_rank", 1024),
        vocab_size=cfg.get("vocab_size", 129280),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        sliding_window=cfg.get("sliding_window", 128),
        attention_layers="" if letters == default_attention_layers(n_layers) else letters,
        csa_ratio=csa,
        hca_ratio=hca,
        index_n_heads=cfg.get("index_n_heads", 64),
        index_head_dim=cfg.get("index_head_dim", 128),
        index_topk=cfg.get("index_topk", 512),
        **rope,
        max_seq_len=cfg.get("max_position_embeddings", 1048576),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hc_mult=cfg.get("hc_mult", 4),
        hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        num_experts=cfg.get("n_routed_experts", cfg.get("num_local_experts", 256)),
        num_experts_per_tok=cfg.get("num_experts_per_tok", 6),
        moe_hidden_dim=cfg.get("moe_intermediate_size", 2048),
        route_scale=float(cfg.get("routed_scaling_factor", 1.5)),
        num_hash_layers=num_hash,
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
    )


def _check_supported(cfg: dict[str, Any]) -> None:
    """ValueError for a model type or a fixed choice of the architecture this family does not run."""
    if cfg.get("model_type") != "deepseek_v4":
        raise ValueError(f"model_type: {cfg.get('model_type')!r} unsupported; allowed: 'deepseek_v4'")
    for key, want in (
        ("num_key_value_heads", 1),
        ("n_shared_experts", 1),
        ("scoring_func", "sqrtsoftplus"),
        ("norm_topk_prob", True),
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
    ):
        if cfg.get(key, want) != want:
            raise ValueError(f"{key}: {cfg[key]!r} unsupported; allowed: {want!r}")


def _num_hash_layers(cfg: dict[str, Any], n_layers: int) -> int:
    """The hash-routed blocks: `mlp_layer_types` (hash_moe blocks first), else `num_hash_layers`."""
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        return min(n_layers, int(cfg.get("num_hash_layers", 3)))
    num_hash = sum(1 for t in mlp_types if t == "hash_moe")
    if list(mlp_types) != ["hash_moe"] * num_hash + ["moe"] * (len(mlp_types) - num_hash):
        raise ValueError(
            "mlp_layer_types: only hash_moe blocks first, then moe blocks, are supported; "
            "allowed: hash_moe, ..., moe, ..."
        )
    return num_hash


def _rope_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The RoPE fields: the rotated width, the bases of the sliding blocks (`main`) and of the CSA/HCA
    blocks (`compress`), and the compressed blocks' YaRN (the sliding ones take default RoPE)."""
    if cfg.get("qk_rope_head_dim") is not None:
        rope_head_dim = int(cfg["qk_rope_head_dim"])
    else:
        rope_head_dim = int(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {}
    compress = params["compress"] if nested else params
    rope_type = compress.get("rope_type", compress.get("type", "default"))
    if rope_type not in ("yarn", "default") or main.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} unsupported; allowed: 'yarn' or 'default' on the "
            "compressed blocks, 'default' on the sliding ones"
        )
    yarn = rope_type == "yarn"
    if yarn and (
        compress.get("attention_factor", 1.0) != 1.0 or compress.get("mscale") or compress.get("mscale_all_dim")
    ):
        raise ValueError("rope_parameters.attention_factor: the tables are not rescaled; allowed: 1.0 or unset")
    return dict(
        rope_head_dim=rope_head_dim,
        rope_theta=float(main.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        compress_rope_theta=float(compress.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))),
        **DeepSeekV4Args.yarn_from_hf(compress if yarn else None),
    )
