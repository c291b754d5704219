"""Hugging Face interop for the `hf` family: the identity on names.

The model's parameter names are the `transformers` ones, so loading is a copy; the only
difference is a tied output matrix, which HF checkpoints store once (as the input embedding)
while our state dict lists it under both names.
"""

from __future__ import annotations

from typing import Any

import torch

from models.common.hf_adapter import HFLayout, apply_layout, whole
from models.hf.args import HFArgs


def _tied(args: HFArgs) -> tuple[str, str] | None:
    """(output key, embedding key) when the model ties them, else None."""
    from transformers import AutoModelForCausalLM

    config = args.config()
    if not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    emb = model.get_input_embeddings().weight
    keys = [n for n, p in model.named_parameters(remove_duplicate=False) if p is emb]
    if len(keys) < 2:
        return None
    emb_key = next(n for n, p in model.named_parameters() if p is emb)  # the name HF saves
    return next(k for k in keys if k != emb_key), emb_key


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """HF state dict -> ours: `hf_layout` applied in memory (the same names; a tied output matrix
    is filled in from the embedding)."""
    return apply_layout(hf_layout({k: tuple(v.shape) for k, v in hf_state_dict.items()}, args), hf_state_dict)


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args: HFArgs) -> HFLayout:
    """Each parameter is the HF tensor of its own name; a tied output matrix is the embedding's."""
    layout = {k: whole(k, shape) for k, shape in hf_shapes.items()}
    tied = _tied(args)
    if tied is not None:
        out_key, emb_key = tied
        if out_key not in layout and emb_key in layout:
            layout[out_key] = layout[emb_key]
    return layout


def to_hf(state_dict: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """Ours -> HF: the same names, a tied output matrix stored once (as HF saves it)."""
    hf_state_dict = dict(state_dict)
    tied = _tied(args)
    if tied is not None:
        hf_state_dict.pop(tied[0], None)
    return hf_state_dict


# Saved by transformers but not part of the architecture (storage dtype, provenance).
_NOT_ARCHITECTURE = ("dtype", "torch_dtype", "_name_or_path", "transformers_version")


def hf_config(args: HFArgs) -> dict[str, Any]:
    """The config.json dict of the model (the config it is built from), without storage keys."""
    return {k: v for k, v in args.config().to_dict().items() if k not in _NOT_ARCHITECTURE}


def args_from_hf_config(cfg: dict[str, Any]) -> HFArgs:
    from transformers import AutoConfig

    raw = dict(cfg)
    return HFArgs.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
