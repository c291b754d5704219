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

The HF -> ours direction is also given as a layout (`decoder_hf_layout`): for each of our
parameters, the boxes of HF tensors it is copied from (`HFEntry`), computed from the HF names
and shapes alone. The per-rank loader (trainer/checkpoint/) reads only the part of each HF
tensor that a rank's shard covers, and scripts/convert.py builds one parameter at a time;
`decoder_from_hf` is the same layout applied to an in-memory state dict.
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HFPiece:
    """A box of one of our tensors that is a box of one Hugging Face tensor (a copy, no arithmetic).

    `start`/`shape` place the box in our tensor; `hf_start` places it in the HF tensor, which may
    lack our leading dims (one expert of a stacked [E, h, d] parameter: our box [j:j+1, :, :] is
    the whole [h, d] HF tensor of expert j, `hf_start` (0, 0))."""

    hf_key: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    hf_start: tuple[int, ...]


@dataclass(frozen=True)
class HFEntry:
    """One of our parameters: its shape and the pieces that tile it (every element exactly once)."""

    shape: tuple[int, ...]
    pieces: tuple[HFPiece, ...]


HFLayout = dict[str, HFEntry]
"""Our parameter name -> how it is made of HF tensors (what an adapter's `hf_layout` returns)."""


def whole(hf_key: str, shape: tuple[int, ...]) -> HFEntry:
    """Our parameter is the HF tensor `hf_key` as it is (a rename)."""
    shape = tuple(shape)
    return HFEntry(shape, (HFPiece(hf_key, (0,) * len(shape), shape, (0,) * len(shape)),))


def read_box(
    entry: HFEntry,
    start: tuple[int, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    read: Callable[[str, tuple[slice, ...]], torch.Tensor],
) -> torch.Tensor:
    """The box [start, start + shape) of our parameter `entry`, made by calling
    `read(hf_key, slices)` for the part of each piece that falls inside it (nothing else is read).

    `dtype` is used only for the result of a box that no single piece covers (several pieces, or
    an empty box); a box inside one piece is returned as `read` gives it (maybe a view).
    """
    start, shape = tuple(start), tuple(shape)
    if any(n == 0 for n in shape):
        return torch.empty(shape, dtype=dtype)
    out = None
    for piece in entry.pieces:
        lo = [max(s, p) for s, p in zip(start, piece.start)]
        hi = [min(s + n, p + m) for s, n, p, m in zip(start, shape, piece.start, piece.shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        lead = len(shape) - len(piece.hf_start)  # our dims the HF tensor lacks (all of size 1 in a piece)
        slices = tuple(
            slice(lo[d] - piece.start[d] + piece.hf_start[d - lead], hi[d] - piece.start[d] + piece.hf_start[d - lead])
            for d in range(lead, len(shape))
        )
        box = tuple(h - low for low, h in zip(lo, hi))
        data = read(piece.hf_key, slices).reshape(box)
        if box == shape:
            return data
        if out is None:
            out = torch.empty(shape, dtype=data.dtype)
        out[tuple(slice(low - s, h - s) for low, h, s in zip(lo, hi, start))] = data
    assert out is not None, f"no piece of {entry} covers the box at {start} of size {shape}"
    return out


def apply_layout(layout: HFLayout, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from an in-memory HF state dict (renames stay views of the HF tensors)."""

    def read(key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        return hf_state_dict[key][slices]

    out = {}
    for name, entry in layout.items():
        dtype = hf_state_dict[entry.pieces[0].hf_key].dtype
        out[name] = read_box(entry, (0,) * len(entry.shape), entry.shape, dtype, read)
    return out


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
_TOP_KEYS = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Per-expert HF projection -> our stacked parameter.
_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_layout_entry(
    out: HFLayout,
    per_expert: dict,
    *,
    key: str,
    shape: tuple[int, ...],
    layer: int,
    rest: str,
    ours: Callable[[str], str],
) -> bool:
    """One HF MoE expert tensor of a layer (`rest` after `model.layers.N.`) into a layout: the
    fused `gate_up_proj` [E, 2 hidden, dim] (gate rows first) splits into `ours("w1")` and
    `ours("w3")`, `down_proj` is `ours("w2")`; a per-expert projection is noted in `per_expert`
    for `stack_expert_entries`. False when `rest` is not an expert tensor."""
    if rest == "mlp.experts.gate_up_proj":
        half = (shape[0], (shape[1] + 1) // 2, *shape[2:])  # torch.chunk(2, dim=1)
        rest_shape = (shape[0], shape[1] - half[1], *shape[2:])
        zero = (0,) * len(shape)
        out[ours("w1")] = HFEntry(half, (HFPiece(key, zero, half, zero),))
        out[ours("w3")] = HFEntry(rest_shape, (HFPiece(key, zero, rest_shape, (0, half[1], *zero[2:])),))
    elif rest == "mlp.experts.down_proj":
        out[ours("w2")] = whole(key, shape)
    elif (expert := _HF_EXPERT.fullmatch(rest)) is not None:
        per_expert.setdefault((layer, _EXPERT_PROJ[expert.group(2)]), {})[int(expert.group(1))] = key
    else:
        return False
    return True


def stack_expert_entries(
    out: HFLayout,
    per_expert: dict,
    hf_shapes: Mapping[str, tuple[int, ...]],
    num_experts: int,
    *,
    ours: Callable[[int, str], str],
) -> None:
    """The per-expert projections `expert_layout_entry` noted, as one stacked [E, ...] entry each
    (`ours(layer, "w1")`...); every layer must hold experts 0..num_experts-1 of one shape."""
    for (layer, name), experts in sorted(per_expert.items()):
        if sorted(experts) != list(range(num_experts)):
            raise ValueError(
                f"model.layers.{layer}.mlp.experts: expected experts 0..{num_experts - 1}, found {sorted(experts)}; "
                f"allowed: one entry per expert, 0..{num_experts - 1}"
            )
        shape = tuple(hf_shapes[experts[0]])
        if any(tuple(hf_shapes[experts[j]]) != shape for j in range(num_experts)):
            raise ValueError(
                f"model.layers.{layer}.mlp.experts: experts of different shapes; allowed: experts of one shape"
            )
        zero = (0,) * len(shape)
        pieces = tuple(HFPiece(experts[j], (j, *zero), (1, *shape), zero) for j in range(num_experts))
        out[ours(layer, name)] = HFEntry((num_experts, *shape), pieces)


def experts_to_hf(
    out: dict[str, torch.Tensor], prefix: str, name: str, value: torch.Tensor, *, w3: torch.Tensor | None, fused: bool
) -> None:
    """Our stacked expert weight `name` (w1, w2 or w3) of the layer `prefix` (`model.layers.N.`)
    as HF tensors: fused (`gate_up_proj` = cat(w1, w3), written at w1; `down_proj`) or one fresh
    tensor per expert (`mlp.experts.j.{gate,up,down}_proj.weight`, the hub layout)."""
    if fused:
        if name == "w1":
            out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([value, w3], dim=1)
        elif name == "w2":
            out[prefix + "mlp.experts.down_proj"] = value
        return
    proj = {ours: hf for hf, ours in _EXPERT_PROJ.items()}[name]
    for j in range(value.shape[0]):
        out[f"{prefix}mlp.experts.{j}.{proj}.weight"] = value[j].clone()


@dataclass(frozen=True)
class DecoderNames:
    """One family's Hugging Face names beside ours, for `decoder_hf_layout` / `decoder_to_hf`.

    `top`: HF key -> ours outside the layers; `layer`: HF key after `model.layers.N.` -> ours after
    `layers.N.` (renames); MoE expert tensors are always understood (`expert_layout_entry`).
    `hf_name` reads a checkpoint's key as the causal LM's (a multimodal checkpoint's language
    model); keys starting with `skip` are not ours (a vision tower, an MTP head). `layer_extra`
    handles a layer tensor that is not a rename (gpt-oss's sinks; a refusal raises), returning its
    entry as `(our name after layers.N., HFEntry)` or None; `extra_to_hf` is its inverse for our
    name after `layers.N.` (None: not one of its names). `family` names the model in errors."""

    family: str = "this family's"
    top: Mapping[str, str] = field(default_factory=lambda: dict(_TOP_KEYS))
    layer: Mapping[str, str] = field(default_factory=lambda: dict(_LAYER_KEYS))
    hf_name: Callable[[str], str] = lambda key: key
    skip: tuple[str, ...] = ()
    layer_extra: Callable[[str, tuple[int, ...], str], tuple[str, HFEntry] | None] = lambda key, shape, rest: None
    extra_to_hf: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None] = lambda rest, value: None


def decoder_hf_layout(
    hf_shapes: Mapping[str, tuple[int, ...]],
    *,
    tie_embeddings: bool,
    num_experts: int = 0,
    names: DecoderNames | None = None,
    expected: list[str] | None = None,
) -> HFLayout:
    """Hugging Face `*ForCausalLM` names and shapes -> how each of our `Decoder` parameters is
    made of them. Every transform here is a copy of boxes (renames, expert stacking, the
    gate/up split of fused experts), so any slice of any parameter reads only its own bytes.
    `names`: the family's names (default: Llama / Qwen 3). `expected`: our full key list; the
    first one missing is named in the ValueError (without it, the embedding and an untied
    `lm_head` are the checked ones)."""
    names = names or DecoderNames()
    out: HFLayout = {}
    per_expert: dict[tuple[int, str], dict[int, str]] = {}
    lm_head = None
    for key, shape in hf_shapes.items():
        shape = tuple(shape)
        name = names.hf_name(key)
        if key.startswith(names.skip) or name.endswith("rotary_emb.inv_freq"):
            continue  # not ours; inv_freq is a buffer some older checkpoints saved (we rebuild RoPE)
        if name == "lm_head.weight":
            lm_head = whole(key, shape)
            continue
        if name in names.top:
            out[names.top[name]] = whole(key, shape)
            continue
        match = _HF_LAYER.fullmatch(name)
        if match is None:
            raise ValueError(
                f"{key}: unknown Hugging Face parameter; allowed: {sorted(names.top)}, lm_head.weight, model.layers.N.*"
            )
        layer, rest = match.group(1), match.group(2)
        if rest in names.layer:
            out[f"layers.{layer}.{names.layer[rest]}"] = whole(key, shape)
        elif (extra := names.layer_extra(key, shape, rest)) is not None:
            out[f"layers.{layer}.{extra[0]}"] = extra[1]
        elif not expert_layout_entry(
            out,
            per_expert,
            key=key,
            shape=shape,
            layer=int(layer),
            rest=rest,
            ours=lambda n, layer=layer: f"layers.{layer}.moe.experts.{n}",
        ):
            raise ValueError(
                f"{key}: unknown Hugging Face parameter in layer {layer}; allowed: "
                f"{', '.join(sorted(names.layer))} and the experts' weights"
            )
    stack_expert_entries(
        out, per_expert, hf_shapes, num_experts, ours=lambda layer, n: f"layers.{layer}.moe.experts.{n}"
    )
    if expected is None and "tok_embeddings.weight" not in out:
        raise ValueError(
            "model.embed_tokens.weight: missing from the Hugging Face state dict; allowed: a state dict that holds it"
        )
    if tie_embeddings:
        if "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
    elif lm_head is not None:
        out["output.weight"] = lm_head
    elif expected is None:
        raise ValueError(
            "lm_head.weight: missing, and tie_word_embeddings is false; allowed: a state dict with lm_head.weight, "
            "or tie_word_embeddings = true"
        )
    missing = sorted(set(expected or ()) - set(out))
    if missing:
        raise ValueError(
            f"{missing[0]}: missing from the Hugging Face state dict; allowed: a complete {names.family} state dict "
            "of this flavor's shape"
        )
    return out


def decoder_from_hf(
    hf_state_dict: dict[str, torch.Tensor],
    *,
    tie_embeddings: bool,
    num_experts: int = 0,
    names: DecoderNames | None = None,
    expected: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Hugging Face `*ForCausalLM` state dict -> our `Decoder` state dict (`decoder_hf_layout`
    applied to it: renamed and split tensors are views of the given ones, stacked experts new)."""
    layout = decoder_hf_layout(
        {k: tuple(v.shape) for k, v in hf_state_dict.items()},
        tie_embeddings=tie_embeddings,
        num_experts=num_experts,
        names=names,
        expected=expected,
    )
    return apply_layout(layout, hf_state_dict)


def decoder_to_hf(
    state_dict: dict[str, torch.Tensor],
    *,
    tie_embeddings: bool,
    fused_experts: bool = False,
    names: DecoderNames | None = None,
) -> dict[str, torch.Tensor]:
    """Our `Decoder` state dict -> Hugging Face `*ForCausalLM` state dict (`names`: the family's).

    Tied models get no `lm_head.weight` (as in HF checkpoints). MoE experts are written one
    tensor per expert (the hub/safetensors layout; each a fresh copy, so safetensors can save
    them) or, with `fused_experts=True`, as the fused tensors transformers 5 modules hold.
    """
    names = names or DecoderNames()
    top_inv = {ours: hf for hf, ours in names.top.items()}
    layer_inv = {ours: hf for hf, ours in names.layer.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight":
            if not tie_embeddings:
                out["lm_head.weight"] = value
            continue
        if key in top_inv:
            out[top_inv[key]] = value
            continue
        match = _OURS_LAYER.fullmatch(key)
        if match is None:
            raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of {names.family} model")
        layer, rest = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in layer_inv:
            out[prefix + layer_inv[rest]] = value
        elif (extra := names.extra_to_hf(rest, value)) is not None:
            out[prefix + extra[0]] = extra[1]
        elif rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
            name = rest.rsplit(".", 1)[1]
            experts_to_hf(
                out, prefix, name, value, w3=state_dict.get(f"layers.{layer}.moe.experts.w3"), fused=fused_experts
            )
        else:
            raise ValueError(f"{key}: unknown model parameter; allowed: the parameters of {names.family} model")
    return out
