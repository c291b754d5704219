"""FLUX conditioning: the T5 / CLIP text encoders and the 16-channel VAE, through the real classes.

FLUX.1 conditions its transformer on
- `t5 [B, S, D_t5]`: the last hidden state of a `transformers.T5EncoderModel` (T5 v1.1 XXL,
  D = 4096, S = 256 for schnell / 512 for dev), called without an attention mask on
  right-padded ids, as BFL's reference and diffusers' FluxPipeline do;
- `clip [B, D_clip]`: the pooled output of a `transformers.CLIPTextModel` (ViT-L/14, D = 768,
  77 tokens): the final-layer-normed hidden state at the first end-of-text token;
- latents `[B, 16, H/8, W/8]` of a `diffusers.AutoencoderKL` (no quant convs), normalized as
  FLUX does: `z = (mean - shift_factor) * scaling_factor` on encode and the inverse on decode
  (the published FLUX VAE has shift 0.1159, scale 0.3611 in its config).

Two ways to get them:
- **local weights** (`load_text_conditioner`, `load_vae`): directories written by
  `save_pretrained` (e.g. the `text_encoder_2/` + `tokenizer_2/` (T5), `text_encoder/` +
  `tokenizer/` (CLIP) and `vae/` folders of a FLUX.1 checkout). Loading never downloads; a
  missing folder is a `ConfigError` naming it.
- **offline debug encoders** (`debug_t5_config`, `debug_clip_config`, `debug_vae_config`):
  the same classes at width 64, randomly initialized. They carry no language knowledge: they
  are fixed random feature maps that give each caption a distinct, deterministic embedding.
  Their ids come from a byte-level BPE passed in by the caller (the project's bundled
  tiktoken BPE; the HF tokenizers need vocab files we do not ship). The debug VAE must
  invert itself to be useful, so `scripts/data/build_flux_data.py` trains it briefly (see
  `trainer.flux_data.build.train_vae`); its shift/scale are then fitted to the latent statistics (mean 0, std 1),
  the job FLUX's constants do for its VAE.

This module imports transformers/diffusers lazily (they take seconds to import) and never
reads config objects or the environment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from models.errors import ConfigError

# The published FLUX.1 VAE normalization (diffusers config of black-forest-labs/FLUX.1-dev/vae).
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16

DEBUG_WIDTH = 64  # T5 and CLIP width of the debug encoders (= debugmodel context_in_dim, vec_in_dim)


# ---------------------------------------------------------------------------------------------
# Tokenization: text -> fixed-length id tensors
# ---------------------------------------------------------------------------------------------
class BpeIds:
    """Fixed-length ids from a byte-level BPE (`encode(text, bos=, eos=) -> list[int]`, `n_vocab`,
    `bos_id`, `eos_id`), for the debug encoders.

    T5 ids: `tokens + [eos]`, right-padded with `pad_id = n_vocab` (one extra embedding row),
    truncated to keep the eos. CLIP ids: `[bos] + tokens + [eos]`, right-padded with eos, as
    OpenAI's CLIP pads; the pooled output is read at the first eos.
    """

    def __init__(self, bpe, *, max_length: int):
        assert max_length >= 3, max_length
        self.bpe, self.max_length = bpe, max_length
        self.vocab_size = bpe.n_vocab + 1
        self.pad_id, self.bos_id, self.eos_id = bpe.n_vocab, bpe.bos_id, bpe.eos_id

    def t5(self, texts: Sequence[str]) -> torch.Tensor:
        rows = []
        for text in texts:
            ids = self.bpe.encode(text, bos=False, eos=False)[: self.max_length - 1] + [self.eos_id]
            rows.append(ids + [self.pad_id] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)

    def clip(self, texts: Sequence[str], length: int) -> torch.Tensor:
        rows = []
        for text in texts:
            ids = [self.bos_id] + self.bpe.encode(text, bos=False, eos=False)[: length - 2] + [self.eos_id]
            rows.append(ids + [self.eos_id] * (length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


class HfIds:
    """Fixed-length ids from Hugging Face tokenizers loaded from local folders (real weights):
    T5 padded to `max_length`, CLIP to its 77 positions, both truncated, as FluxPipeline does."""

    def __init__(self, t5_tokenizer, clip_tokenizer, *, max_length: int):
        self.t5_tok, self.clip_tok, self.max_length = t5_tokenizer, clip_tokenizer, max_length

    def t5(self, texts: Sequence[str]) -> torch.Tensor:
        return self.t5_tok(
            list(texts), padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        ).input_ids

    def clip(self, texts: Sequence[str], length: int) -> torch.Tensor:
        return self.clip_tok(
            list(texts), padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).input_ids


# ---------------------------------------------------------------------------------------------
# Debug configurations (width 64, randomly initialized)
# ---------------------------------------------------------------------------------------------
def debug_t5_config(vocab_size: int, *, width: int = DEBUG_WIDTH):
    """T5 v1.1-style encoder (gated GELU, relative position buckets) at width 64, 2 layers."""
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=width,
        d_kv=width // 4,
        d_ff=2 * width,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        is_encoder_decoder=False,
        pad_token_id=vocab_size - 1,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


def debug_clip_config(
    vocab_size: int, *, eos_token_id: int, bos_token_id: int, max_positions: int, width: int = DEBUG_WIDTH
):
    """CLIP text transformer (causal, quick-GELU, learned positions) at width 64, 2 layers."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_positions,
        hidden_act="quick_gelu",
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        pad_token_id=eos_token_id,
    )


def debug_vae_config() -> dict:
    """A small `AutoencoderKL` with FLUX's latent layout (16 channels, no quant convs).

    Three resolution levels, so the spatial factor is 4 (FLUX's VAE has four: factor 8): a
    32x32 debug image gives an 8x8 latent, 16 image tokens after 2x2 packing.
    """
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        scaling_factor=FLUX_VAE_SCALING_FACTOR,
        shift_factor=FLUX_VAE_SHIFT_FACTOR,
    )


# ---------------------------------------------------------------------------------------------
# Text conditioner
# ---------------------------------------------------------------------------------------------
class TextConditioner:
    """Prompts -> (t5 [B, S, D_t5], clip [B, D_clip]) float32, in eval mode, without gradients."""

    def __init__(self, t5_model, clip_model, ids: BpeIds | HfIds):
        self.t5_model, self.clip_model, self.ids = t5_model.eval(), clip_model.eval(), ids
        self.max_length = ids.max_length
        self.clip_length = clip_model.config.max_position_embeddings

    @property
    def t5_dim(self) -> int:
        return self.t5_model.config.d_model

    @property
    def clip_dim(self) -> int:
        return self.clip_model.config.hidden_size

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        texts = list(texts)
        t5_ids = self.ids.t5(texts).to(self.t5_model.device)
        clip_ids = self.ids.clip(texts, self.clip_length).to(self.clip_model.device)
        t5 = self.t5_model(input_ids=t5_ids).last_hidden_state
        clip = self.clip_model(input_ids=clip_ids).pooler_output
        return t5.float(), clip.float()

    def save(self, folder: str) -> None:
        """Both encoders as `save_pretrained` folders `folder/t5` and `folder/clip`, each with
        its Hugging Face tokenizer when it has one (so `load_text_conditioner` reloads both)."""
        self.t5_model.save_pretrained(os.path.join(folder, "t5"))
        self.clip_model.save_pretrained(os.path.join(folder, "clip"))
        if isinstance(self.ids, HfIds):
            self.ids.t5_tok.save_pretrained(os.path.join(folder, "t5"))
            self.ids.clip_tok.save_pretrained(os.path.join(folder, "clip"))


def build_debug_text_conditioner(bpe, *, max_length: int, seed: int) -> TextConditioner:
    """Randomly initialized width-64 T5 and CLIP (the offline default), deterministic in `seed`."""
    from transformers import CLIPTextModel, T5EncoderModel

    ids = BpeIds(bpe, max_length=max_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        t5 = T5EncoderModel(debug_t5_config(ids.vocab_size))
        clip = CLIPTextModel(
            debug_clip_config(
                ids.vocab_size, eos_token_id=ids.eos_id, bos_token_id=ids.bos_id, max_positions=max_length
            )
        )
    return TextConditioner(t5, clip, ids)


def _require_dir(path: str, what: str) -> str:
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"{what}: folder {path} does not exist; allowed: a local folder written by "
            "save_pretrained (weights are never downloaded)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"{what}: folder {path} has no config.json; allowed: a local folder written by save_pretrained"
        )
    return path


def load_text_conditioner(
    *,
    t5_path: str,
    clip_path: str,
    max_length: int,
    bpe=None,
    t5_tokenizer_path: str | None = None,
    clip_tokenizer_path: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TextConditioner:
    """Encoders from local folders (`local_files_only`: never downloads).

    Ids: with `bpe` (the debug encoders) from the BPE; otherwise from Hugging Face tokenizers
    in `t5_tokenizer_path` / `clip_tokenizer_path` (default: the model folders themselves).
    """
    from transformers import CLIPTextModel, T5EncoderModel

    t5_path = _require_dir(t5_path, "T5 encoder weights")
    clip_path = _require_dir(clip_path, "CLIP text encoder weights")
    t5 = T5EncoderModel.from_pretrained(t5_path, local_files_only=True, dtype=dtype).to(device)
    clip = CLIPTextModel.from_pretrained(clip_path, local_files_only=True, dtype=dtype).to(device)
    if bpe is not None:
        return TextConditioner(t5, clip, BpeIds(bpe, max_length=max_length))
    from transformers import AutoTokenizer

    tokenizers = []
    for path, what in (
        (t5_tokenizer_path or t5_path, "T5 tokenizer"),
        (clip_tokenizer_path or clip_path, "CLIP tokenizer"),
    ):
        path = os.path.expanduser(path)
        if not os.path.isdir(path):
            raise ConfigError(f"{what}: folder {path} does not exist; allowed: a local tokenizer folder")
        try:
            tokenizers.append(AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{what}: cannot load a tokenizer from {path} ({type(e).__name__}); allowed: a "
                "folder with tokenizer files (tokenizer.json or spiece.model / vocab.json)"
            ) from None
    return TextConditioner(t5, clip, HfIds(*tokenizers, max_length=max_length))


# ---------------------------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------------------------
class FluxVae:
    """`diffusers.AutoencoderKL` with FLUX's latent normalization. Images are [B, 3, H, W] in [0, 1]."""

    def __init__(self, autoencoder):
        self.autoencoder = autoencoder.eval()
        cfg = autoencoder.config
        if cfg.latent_channels != LATENT_CHANNELS:
            raise ConfigError(
                f"VAE: latent_channels is {cfg.latent_channels}; FLUX needs {LATENT_CHANNELS}; allowed: a VAE with {LATENT_CHANNELS} latent channels"
            )
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(cfg.shift_factor or 0.0)
        self.spatial_factor = 2 ** (len(cfg.block_out_channels) - 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Normalized latents [B, 16, H/f, W/f] from the posterior mean (deterministic)."""
        return (self.encode_raw(images) - self.shift_factor) * self.scaling_factor

    def encode_raw(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.autoencoder.dtype) * 2 - 1
        return self.autoencoder.encode(x).latent_dist.mean.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] from normalized latents."""
        z = latents.to(self.autoencoder.dtype) / self.scaling_factor + self.shift_factor
        return ((self.autoencoder.decode(z).sample.float() + 1) / 2).clamp(0, 1)

    def save(self, folder: str) -> None:
        self.autoencoder.save_pretrained(folder)


def build_debug_vae(seed: int) -> FluxVae:
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FluxVae(AutoencoderKL(**debug_vae_config()))


def load_vae(path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> FluxVae:
    """A local `AutoencoderKL` folder (e.g. FLUX.1's `vae/`); never downloads."""
    from diffusers import AutoencoderKL

    path = _require_dir(path, "VAE weights")
    return FluxVae(AutoencoderKL.from_pretrained(path, local_files_only=True, torch_dtype=dtype).to(device))


def describe(vae: FluxVae, text: TextConditioner) -> dict:
    """JSON-able summary of the conditioning (stored in the data set's meta.json)."""
    return {
        "t5_dim": text.t5_dim,
        "clip_dim": text.clip_dim,
        "max_length": text.max_length,
        "latent_channels": LATENT_CHANNELS,
        "vae_spatial_factor": vae.spatial_factor,
        "vae_scaling_factor": vae.scaling_factor,
        "vae_shift_factor": vae.shift_factor,
    }


__all__ = [
    "BpeIds",
    "HfIds",
    "TextConditioner",
    "FluxVae",
    "build_debug_text_conditioner",
    "build_debug_vae",
    "load_text_conditioner",
    "load_vae",
    "describe",
    "debug_t5_config",
    "debug_clip_config",
    "debug_vae_config",
    "FLUX_VAE_SCALING_FACTOR",
    "FLUX_VAE_SHIFT_FACTOR",
]
