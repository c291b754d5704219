"""Hugging Face interop for DeepSeek-V3 (and Kimi K2): `DeepseekV3ForCausalLM`.

Key map (HF `model.layers.N.` <-> ours `dense_layers.N.` for N < n_dense_layers, else
`moe_layers.{N - n_dense_layers}.`): `self_attn.{q_proj, q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}` <-> `attention.{wq, wq_a, q_norm, wq_b,
wkv_a, kv_norm, wkv_b, wo}`; `mlp.{gate,up,down}_proj` <-> `feed_forward.w{1,3,2}`;
`mlp.gate.weight` / `mlp.gate.e_score_correction_bias` <-> `moe.router.gate.weight` /
`moe.router.expert_bias`; `mlp.shared_experts.*` <-> `moe.shared_experts.*`; experts per expert
(hub layout) or fused (`gate_up_proj`, `down_proj`, transformers 5 modules) <-> stacked
`moe.experts.w1/w3/w2`.

RoPE layout: DeepSeek checkpoints (`rope_interleave: true`) rotate adjacent pairs of the rope
dims; ours rotates halves ("rotate_half"). The two agree exactly once the rope rows of each
head's query (`q_proj`/`q_b_proj`) and of the shared key (`kv_a_proj_with_mqa`) are permuted
from (0, 1, 2, ...) to (0, 2, 4, ..., 1, 3, 5, ...): `from_hf` does that, `to_hf` undoes it.
Multi-token prediction: DeepSeek-V3's checkpoint stores MTP module k (k = 1..D, HF
`num_nextn_predict_layers` = D) as layer `n_layers + k - 1`: a decoder layer (mapped as any
layer, to `mtp.{k-1}.layers.0.*`) plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` <->
`mtp.{k-1}.{enorm, hnorm, eh_proj, norm}`, and its own copies of the embedding and the head
(`embed_tokens`, `shared_head.head`), which `to_hf` writes from the shared ones and `from_hf`
skips (the model shares them). With `mtp_depth` = 0 (every flavor) those layers are skipped.
`hf_config` writes `num_nextn_predict_layers` when `mtp_depth` > 0; `args_from_hf_config` does not
read it (the depth is the run's `[model] mtp_depth`): transformers writes 1 into every DeepSeek-V3
config.json it saves but no MTP weights, so the value does not say whether a folder has them.
"""

import re
from typing import Any

import torch

from models.common.hf_adapter import (
    HFEntry,
    HFLayout,
    HFPiece,
    apply_layout,
    expert_layout_entry,
    experts_to_hf,
    stack_expert_entries,
    whole,
)
from models.deepseek_v3.args import DeepSeekV3Args

_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "moe.router.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
}
_LAYER_INV = {ours: hf for hf, ours in _LAYER.items()}
_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_TOP_INV = {ours: hf for hf, ours in _TOP.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OURS_LAYER = re.compile(r"(dense_layers|moe_layers)\.(\d+)\.(.+)")
# The MTP layer's own parameters (HF rest of `model.layers.{n_layers + k - 1}.` <-> ours of `mtp.{k-1}.`),
# and its copies of the shared embedding and head (HF only).
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
}
_MTP_INV = {ours: hf for hf, ours in _MTP.items()}
_MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
_OURS_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_MTP_BLOCK = "layers.0."


def _rope_rows(weight: torch.Tensor, args: DeepSeekV3Args, *, key: bool, to_half: bool) -> torch.Tensor:
    """Permute the rope rows of a query projection ([heads * qk_head_dim, in]) or of wkv_a
    ([kv_lora_rank + rope, in]) between the interleaved and the half layout (a new tensor)."""
    r = args.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    if not to_half:
        perm = torch.argsort(perm)
    if key:
        lead = args.kv_lora_rank
        return torch.cat([weight[:lead], weight[lead:][perm]])
    w = weight.view(-1, args.qk_head_dim, weight.shape[-1])
    rope = w[:, args.qk_nope_head_dim :][:, perm]
    return torch.cat([w[:, : args.qk_nope_head_dim], rope], dim=1).reshape(weight.shape)


def _ours(layer: int, rest: str, args: DeepSeekV3Args) -> str:
    if layer < args.n_dense_layers:
        return f"dense_layers.{layer}.{rest}"
    if layer >= args.n_layers:  # MTP module layer - n_layers + 1's block
        return f"mtp.{layer - args.n_layers}.{_MTP_BLOCK}{rest}"
    return f"moe_layers.{layer - args.n_dense_layers}.{rest}"


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args, *, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 state dict (per-expert hub layout or transformers-5 fused experts) -> ours:
    `hf_layout` applied to the tensors. `rope_interleave`: the checkpoint's config value (True for
    DeepSeek-V3 and Kimi K2)."""
    layout = hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args, rope_interleave=rope_interleave)
    return apply_layout(layout, hf_state_dict)


def _rope_entry(key: str, shape: tuple[int, ...], args: DeepSeekV3Args, *, is_key: bool) -> HFEntry:
    """`_rope_rows(..., to_half=True)` as boxes: the non-rope rows as blocks, each rope row alone
    (our row j of a head's rope part is HF row perm[j])."""
    r, cols = args.qk_rope_head_dim, shape[1]
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]).tolist()
    pieces = []
    if is_key:
        blocks = [(0, args.kv_lora_rank)]
    else:
        blocks = [(h * args.qk_head_dim, args.qk_nope_head_dim) for h in range(shape[0] // args.qk_head_dim)]
    for start, rows in blocks:
        pieces.append(HFPiece(key, (start, 0), (rows, cols), (start, 0)))
        pieces.extend(HFPiece(key, (start + rows + j, 0), (1, cols), (start + rows + perm[j], 0)) for j in range(r))
    return HFEntry(tuple(shape), tuple(pieces))


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: DeepSeekV3Args, *, rope_interleave: bool = True) -> HFLayout:
    """HF names and shapes -> how each of our parameters is made of them (models/common/hf_adapter.py),
    for per-rank loading, `scripts/convert.py from-hf` and `from_hf`. `rope_interleave` (every
    DeepSeek-V3 / Kimi K2 checkpoint): the rope rows of the query and key projections are
    permuted to the half layout; without it they are taken as they are."""
    out: HFLayout = {}
    per_expert: dict[tuple[int, str], dict[int, str]] = {}
    for key, shape in hf_shapes.items():
        shape = tuple(shape)
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key in _TOP:
            out[_TOP[key]] = whole(key, shape)
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"{key}: unknown Hugging Face parameter; allowed: {sorted(_TOP)} + model.layers.N.*")
        layer, rest = int(match.group(1)), match.group(2)
        if layer >= args.n_layers + args.mtp_depth:  # an MTP layer this model does not have
            continue
        if layer >= args.n_layers and rest in _MTP_SHARED:  # the MTP layer's copy of a shared matrix
            continue
        if layer >= args.n_layers and rest in _MTP:
            out[f"mtp.{layer - args.n_layers}.{_MTP[rest]}"] = whole(key, shape)
        elif rope_interleave and rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
            out[_ours(layer, _LAYER[rest], args)] = _rope_entry(key, shape, args, is_key=False)
        elif rope_interleave and rest == "self_attn.kv_a_proj_with_mqa.weight":
            out[_ours(layer, _LAYER[rest], args)] = _rope_entry(key, shape, args, is_key=True)
        elif rest in _LAYER:
            out[_ours(layer, _LAYER[rest], args)] = whole(key, shape)
        elif not expert_layout_entry(
            out,
            per_expert,
            key=key,
            shape=shape,
            layer=layer,
            rest=rest,
            ours=lambda n, layer=layer: _ours(layer, f"moe.experts.{n}", args),
        ):
            raise ValueError(
                f"{key}: unknown Hugging Face parameter in layer {layer}; allowed: a DeepSeek-V3 layer's "
                "parameters (self_attn.*, mlp.*, the norms)"
            )
    stack_expert_entries(
        out, per_expert, hf_shapes, args.num_experts, ours=lambda layer, n: _ours(layer, f"moe.experts.{n}", args)
    )
    if "tok_embeddings.weight" not in out:
        raise ValueError(
            "model.embed_tokens.weight: missing from the Hugging Face state dict; allowed: a state dict that holds it"
        )
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    elif "output.weight" not in out:
        raise ValueError(
            "lm_head.weight: missing, and tie_word_embeddings is false; allowed: a state dict with lm_head.weight, "
            "or tie_word_embeddings = true"
        )
    return out


def to_hf(
    state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args, *, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF DeepSeek-V3 (`rope_interleave: true`, as `hf_config` writes); experts
    one tensor per expert (hub layout) unless `fused_experts`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
            continue
        mtp = _OURS_MTP.fullmatch(key)
        if mtp is not None:
            layer, rest = args.n_layers + int(mtp.group(1)), mtp.group(2)
            if rest in _MTP_INV:
                out[f"model.layers.{layer}.{_MTP_INV[rest]}"] = value
                continue
            if not rest.startswith(_MTP_BLOCK):
                raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of DeepSeekV3Model")
            rest = rest[len(_MTP_BLOCK) :]
        else:
            match = _OURS_LAYER.fullmatch(key)
            if match is None:
                raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of DeepSeekV3Model")
            stack, index, rest = match.groups()
            layer = int(index) + (args.n_dense_layers if stack == "moe_layers" else 0)
        prefix = f"model.layers.{layer}."
        if rest in ("attention.wq.weight", "attention.wq_b.weight"):
            value = _rope_rows(value, args, key=False, to_half=False)
        elif rest == "attention.wkv_a.weight":
            value = _rope_rows(value, args, key=True, to_half=False)
        if rest in _LAYER_INV:
            out[prefix + _LAYER_INV[rest]] = value
        elif rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
            name = rest.rsplit(".", 1)[1]
            experts_to_hf(out, prefix, name, value, w3=state_dict.get(key[: -len(name)] + "w3"), fused=fused_experts)
        else:
            raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of DeepSeekV3Model")
    for k in range(args.mtp_depth):  # the checkpoint's MTP layers carry copies of the shared matrices
        for hf, ours in _MTP_SHARED.items():
            if ours in state_dict:
                out[f"model.layers.{args.n_layers + k}.{hf}"] = state_dict[ours]
    return out


# The linears of attention, the dense MLP, the shared and the routed experts (per-expert hub names).
_FP8_HUB_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?[a-z_]+_proj(_with_mqa)?\.weight")


def fp8_hub_weight(hf_key: str, shape: tuple[int, ...]) -> bool:
    """Whether DeepSeek-V3's and Kimi K2's FP8 hub checkpoints store `hf_key` as float8_e4m3fn with
    a 128x128 block `weight_scale_inv`: the 2-d `*_proj` weights of attention (`q_proj`, `q_a_proj`,
    `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), the dense MLP, the shared and the
    routed experts. Not quantized there: the embeddings, norms, the router gate `mlp.gate.weight`,
    `e_score_correction_bias`, and `lm_head` (trainer/checkpoint/hf_fp8.py has the format)."""
    return len(shape) == 2 and _FP8_HUB_WEIGHT.fullmatch(hf_key) is not None


def hf_config(args: DeepSeekV3Args) -> dict[str, Any]:
    """A `config.json` dict for `DeepseekV3ForCausalLM` (sigmoid routing only)."""
    if args.score_func != "sigmoid":
        raise ValueError(f"model.score_func: {args.score_func!r} has no DeepseekV3ForCausalLM form; allowed: 'sigmoid'")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor > 1.0:
        rope = {
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            **args.yarn_hf(),
            "mscale": args.rope_mscale,
            "mscale_all_dim": args.rope_mscale_all_dim,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.num_shared_experts,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "routed_scaling_factor": args.route_scale,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_group": args.num_expert_groups,
        "topk_group": args.num_limited_groups,
        "norm_topk_prob": args.norm_topk_prob,
        "first_k_dense_replace": args.n_dense_layers,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "rope_interleave": True,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # Written only with MTP, so that a model without it keeps its config.json.
        **({"num_nextn_predict_layers": args.mtp_depth} if args.mtp_depth else {}),
    }


def args_from_hf_config(cfg: dict[str, Any]) -> DeepSeekV3Args:
    """`DeepSeekV3Args` from a DeepSeek-V3 / Kimi K2 `config.json`; ValueError if unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"model_type: {model_type!r} unsupported; allowed: 'deepseek_v3', 'kimi_k2'")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias: biases are not supported; allowed: false")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {cfg['hidden_act']!r} unsupported; allowed: 'silu'")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            "scoring_func/topk_method: only sigmoid scores with noaux_tc selection are supported; "
            "allowed: scoring_func = 'sigmoid', topk_method = 'noaux_tc'"
        )
    if not cfg.get("rope_interleave", True):
        raise ValueError(
            "rope_interleave: only the interleaved RoPE layout of DeepSeek checkpoints is converted; allowed: true"
        )
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError("moe_layer_freq: only 1 (every block after the dense ones is MoE) is supported; allowed: 1")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_parameters.rope_type: {rope_type!r} unsupported; allowed: 'default', 'yarn'")
    yarn = DeepSeekV3Args.yarn_from_hf(rope if rope_type == "yarn" else None)
    if rope_type == "yarn":  # DeepSeek's attention temperature (models/deepseek_v3/model.py)
        yarn.update(
            rope_mscale=float(rope.get("mscale") or 1.0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0)
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return DeepSeekV3Args(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_dense_layers=cfg.get("first_k_dense_replace", 3),
        n_heads=cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        hidden_dim=cfg["intermediate_size"],
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        num_experts=cfg["n_routed_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        moe_hidden_dim=cfg["moe_intermediate_size"],
        num_expert_groups=cfg.get("n_group") or 1,
        num_limited_groups=cfg.get("topk_group") or 1,
        route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_seq_len=cfg.get("max_position_embeddings", 163840),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **yarn,
    )
