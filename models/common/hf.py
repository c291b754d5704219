"""State-dict conversion between our `Decoder` names and Hugging Face Llama/Qwen 3 names.

Because RoPE uses the Hugging Face rotate_half layout, conversion is a pure rename (no q/k
permutation), plus two structural cases:
- tied embeddings: HF checkpoints omit `lm_head.weight`; our state dict lists the shared
  matrix under both `tok_embeddings.weight` and `output.weight`.
- MoE experts: we stack experts ([E, hidden, dim] / [E, dim, hidden]). Hub checkpoints (and
  `save_pretrained` in transformers 5, which converts back to the original format) store one
  tensor per expert (`mlp.experts.{j}.gate_proj.weight`, ...); the in-memory modules of
  transformers 5 hold fused `mlp.experts.gate_up_proj` [E, 2*hidden, dim] (gate rows first) and
  `mlp.experts.down_proj` [E, dim, hidden]. `decoder_from_hf` accepts both; `decoder_to_hf` writes
  the per-expert hub layout unless `fused_experts=True`.
Keys are bare (no `model.` DCP prefix); tensors are returned as given or as new stacked/split
tensors, never modified in place.
"""

import re

import torch

# HF key (after "model.layers.{i}.") -> our key (after "layers.{i}.")
_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
}
_LAYER_KEYS_INV = {ours: hf for hf, ours in _LAYER_KEYS.items()}
_TOP_KEYS = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
_TOP_KEYS_INV = {ours: hf for hf, ours in _TOP_KEYS.items()}

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Per-expert HF projection -> our stacked parameter.
_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def decoder_from_hf(
    hf_state_dict: dict[str, torch.Tensor], *, tie_embeddings: bool, num_experts: int = 0
) -> dict[str, torch.Tensor]:
    """Hugging Face `*ForCausalLM` state dict -> our `Decoder` state dict."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    lm_head = None
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some older checkpoints saved; we rebuild RoPE tables ourselves
        if key == "lm_head.weight":
            lm_head = value
            continue
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = value
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"{key}: unknown Hugging Face parameter; allowed: {sorted(_TOP_KEYS)} + model.layers.N.*")
        layer, rest = match.group(1), match.group(2)
        if rest in _LAYER_KEYS:
            out[f"layers.{layer}.{_LAYER_KEYS[rest]}"] = value
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            out[f"layers.{layer}.moe.experts.w1"] = gate
            out[f"layers.{layer}.moe.experts.w3"] = up
        elif rest == "mlp.experts.down_proj":
            out[f"layers.{layer}.moe.experts.w2"] = value
        elif (expert := _HF_EXPERT.fullmatch(rest)) is not None:
            slot = (int(layer), _EXPERT_PROJ[expert.group(2)])
            per_expert.setdefault(slot, {})[int(expert.group(1))] = value
        else:
            raise ValueError(f"{key}: unknown Hugging Face parameter in layer {layer}")
    for (layer, name), experts in sorted(per_expert.items()):
        if sorted(experts) != list(range(num_experts)):
            raise ValueError(
                f"model.layers.{layer}.mlp.experts: expected experts 0..{num_experts - 1}, found {sorted(experts)}"
            )
        out[f"layers.{layer}.moe.experts.{name}"] = torch.stack([experts[j] for j in range(num_experts)])
    if "tok_embeddings.weight" not in out:
        raise ValueError("model.embed_tokens.weight: missing from the Hugging Face state dict")
    if tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    elif lm_head is None:
        raise ValueError("lm_head.weight: missing, and tie_word_embeddings is false")
    else:
        out["output.weight"] = lm_head
    return out


def decoder_to_hf(
    state_dict: dict[str, torch.Tensor], *, tie_embeddings: bool, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Our `Decoder` state dict -> Hugging Face `*ForCausalLM` state dict.

    Tied models get no `lm_head.weight` (as in HF checkpoints). MoE experts are written one
    tensor per expert (the hub/safetensors layout; each a fresh copy, so safetensors can save
    them) or, with `fused_experts=True`, as the fused tensors transformers 5 modules hold.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight":
            if not tie_embeddings:
                out["lm_head.weight"] = value
            continue
        if key in _TOP_KEYS_INV:
            out[_TOP_KEYS_INV[key]] = value
            continue
        match = _OURS_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"{key}: unknown model parameter")
        layer, rest = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _LAYER_KEYS_INV:
            out[prefix + _LAYER_KEYS_INV[rest]] = value
        elif rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
            name = rest.rsplit(".", 1)[1]
            if fused_experts:
                if name == "w1":
                    w3 = state_dict[f"layers.{layer}.moe.experts.w3"]
                    out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([value, w3], dim=1)
                elif name == "w2":
                    out[prefix + "mlp.experts.down_proj"] = value
                continue
            proj = {ours: hf for hf, ours in _EXPERT_PROJ.items()}[name]
            for j in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{j}.{proj}.weight"] = value[j].clone()
        else:
            raise ValueError(f"{key}: unknown model parameter")
    return out
