"""`HFArgs`: the sizes of a Hugging Face causal LM, read from its config.json (no download).

The architecture is whatever `transformers` builds for the config (`AutoModelForCausalLM`), so
the args hold only what the trainer may set (`n_layers`, `vocab_size`, `max_seq_len`) and the
path; everything else comes from the config. Parameter counts are exact: the model is built on
the meta device once and its parameters are counted (no per-architecture formula to drift).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from models.contract import ModelShape


@dataclass
class HFArgs:
    hf_config: str = ""
    """A local directory holding config.json, or the config.json file itself (never downloaded)."""
    n_layers: int = 0
    """Decoder layers; 0 = the config's `num_hidden_layers` (a smaller value truncates the model)."""
    vocab_size: int = 0
    """Vocabulary; 0 = the config's `vocab_size`."""
    max_seq_len: int = 0
    """Longest training sequence (the trainer sets it to training.seq_len); informational: HF
    models compute their RoPE tables from the position ids of each forward."""

    def __post_init__(self) -> None:
        self._config = None
        if not self.hf_config:
            return  # the registered flavor: the trainer requires [model] hf_config
        config = load_config(self.hf_config)
        if self.n_layers < 0 or self.vocab_size < 0:
            raise ValueError(
                "n_layers: must be >= 0 (0 = the config's value); allowed: >= 0"
                if self.n_layers < 0
                else "vocab_size: must be >= 0 (0 = the config's value); allowed: >= 0"
            )
        self._config = _with_sizes(config, n_layers=self.n_layers, vocab_size=self.vocab_size)
        text = self._config.get_text_config()
        self.n_layers = text.num_hidden_layers
        self.vocab_size = text.vocab_size

    @classmethod
    def from_config(cls, config: Any) -> "HFArgs":
        """Args of an in-memory `PretrainedConfig` (used by the HF adapter; no file)."""
        args = cls()
        args._config = config
        text = config.get_text_config()
        args.n_layers, args.vocab_size = text.num_hidden_layers, text.vocab_size
        return args

    def config(self) -> Any:
        """A copy of the `transformers` config the model is built from (with n_layers / vocab_size)."""
        if self._config is None:
            raise ValueError(
                'hf_config: required with model.name = "hf"; allowed: a local directory '
                "holding config.json, or a config.json file"
            )
        return copy.deepcopy(self._config)

    @property
    def architecture(self) -> str:
        cfg = self.config()
        return (cfg.architectures or [type(cfg).__name__])[0]

    def shape(self) -> ModelShape:
        text = self.config().get_text_config()
        n_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        num_experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
        return ModelShape(
            n_layers=text.num_hidden_layers,
            dim=text.hidden_size,
            n_heads=n_heads,
            n_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            ffn_hidden=0 if num_experts else int(getattr(text, "intermediate_size", 0) or 0),
            num_experts=num_experts,
            top_k=int(getattr(text, "num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_hidden=int(getattr(text, "moe_intermediate_size", 0) or 0) if num_experts else 0,
        )

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        counts = _counts(_config_key(self.config()))
        return counts["total"] - (counts["embedding"] if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters a token goes through: routed expert weights (modules named `experts`)
        count top_k / num_experts of their size; the rest fully."""
        counts = _counts(_config_key(self.config()))
        shape = self.shape()
        experts = counts["experts"]
        active_experts = experts * shape.top_k // shape.num_experts if shape.num_experts else experts
        total = counts["total"] - experts + active_experts
        return total - (counts["embedding"] if exclude_embedding else 0)


def load_config(path: str) -> Any:
    """The `PretrainedConfig` of `path` (a directory with config.json, or the file); ValueError
    naming `hf_config` and what is allowed otherwise. Never downloads."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(
            "hf_config: the hf family needs the transformers package; allowed: install "
            "the [hf] extra (pip install -e '.[hf]')"
        ) from None

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"hf_config: {path!r} is not a config.json file or a directory holding one; "
            "allowed: a local directory with config.json, or the file (nothing is downloaded)"
        )
    try:
        with open(file) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
        model_type = raw.pop("model_type")
        config = AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # noqa: BLE001 - transformers' strict fields raise their own error types
        reason = " ".join(str(e).split()) if str(e) else ""
        raise ValueError(
            f"hf_config: cannot read {file} as a transformers config ({type(e).__name__}: {reason}); "
            "allowed: a config.json with a model_type that transformers knows"
        ) from None
    _check_sizes(config, file)
    try:  # what the architecture itself refuses (built once on the meta device; cached for the counts)
        _counts(_config_key(config))
    except Exception as e:  # noqa: BLE001 - any failure to build from this file is bad input
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"hf_config: {file} does not build a model ({type(e).__name__}: {reason}); "
            "allowed: a config.json whose sizes fit its architecture"
        ) from None
    return config


_POSITIVE_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "vocab_size",
    "max_position_embeddings",
)
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta")


def _check_sizes(config: Any, file: str) -> None:
    """Sizes of the text config: positive integers and finite positive numbers where set, heads
    that divide (query heads by key/value heads, the width by the heads when head_dim is unset).
    ValueError naming the file and the field."""
    import math

    text = config.get_text_config()
    values = {
        **{k: getattr(text, k, None) for k in _POSITIVE_INTS + _POSITIVE_FLOATS},
        **{k: v for k, v in (getattr(text, "rope_parameters", None) or {}).items() if k == "rope_theta"},
    }
    for key in _POSITIVE_INTS:
        v = values[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"hf_config: {file}: {key} = {v!r}; allowed: an integer >= 1")
    for key in _POSITIVE_FLOATS:
        v = values[key]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0):
            raise ValueError(f"hf_config: {file}: {key} = {v!r}; allowed: a finite number > 0")
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if heads and kv and heads % kv:
        raise ValueError(
            f"hf_config: {file}: num_attention_heads = {heads} is not a multiple of "
            f"num_key_value_heads = {kv}; allowed: key/value heads that divide the query heads"
        )
    if heads and values["hidden_size"] and not values["head_dim"] and values["hidden_size"] % heads:
        raise ValueError(
            f"hf_config: {file}: hidden_size = {values['hidden_size']} is not a multiple of "
            f"num_attention_heads = {heads} (and head_dim is not set); allowed: a config that sets head_dim, "
            "or a hidden_size the heads divide"
        )


def _with_sizes(config: Any, *, n_layers: int, vocab_size: int) -> Any:
    config = copy.deepcopy(config)
    text = config.get_text_config()
    if n_layers:
        if n_layers > text.num_hidden_layers:
            raise ValueError(
                f"n_layers: {n_layers} is more than the config's {text.num_hidden_layers}; "
                f"allowed: 1..{text.num_hidden_layers} (or 0 for all)"
            )
        text.num_hidden_layers = n_layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = list(text.layer_types)[:n_layers]
    if vocab_size:
        text.vocab_size = vocab_size
    return config


def _config_key(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


@functools.lru_cache(maxsize=16)
def _counts(config_json: str) -> dict[str, int]:
    """Distinct parameters of the model built on meta: total, input embedding, routed experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_json)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # a tied matrix once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    experts = sum(p.numel() for n, p in params.items() if ".experts." in f".{n}")
    return {
        "total": sum(p.numel() for p in params.values()),
        # A tied table is also the output projection, which every token goes through.
        "embedding": 0 if tied else embedding.numel(),
        "experts": experts,
    }
