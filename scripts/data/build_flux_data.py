"""Build a FLUX precomputed-embedding data set: procedural captioned images -> parquet.

Renders the procedural set (trainer/flux_data/build.py: one coloured shape at one position per
image, "a red circle on the left"), encodes every image with the VAE and every caption with
T5 and CLIP, and writes parquet shards of (index, caption, colour, shape, position,
latent [16, h, w], t5 [S, D], clip [D]) for the `train` and `heldout` splits, plus the
encoders and VAE it used (`encoders/t5`, `encoders/clip`, `vae/`), so sampling encodes
prompts and decodes latents with the same models. See docs/flux_data.md.

    python scripts/data/build_flux_data.py                      # the debug set, into the cache
    python scripts/data/build_flux_data.py --out DIR            # the debug set, into DIR
    python scripts/data/build_flux_data.py --out DIR --image-size 256 --text-length 256 \\
        --t5 FLUX.1-schnell/text_encoder_2 --t5-tokenizer FLUX.1-schnell/tokenizer_2 \\
        --clip FLUX.1-schnell/text_encoder --clip-tokenizer FLUX.1-schnell/tokenizer \\
        --vae FLUX.1-schnell/vae                           # real weights, from local folders

Without local weights the encoders are the randomly initialized width-64 debug T5/CLIP and
a small AutoencoderKL trained here for --vae-steps steps. Nothing is ever downloaded. The
training loader builds the debug set by itself on first use (dataset "procedural"); this
script is for other parameters, other folders, and real weights. Bad input prints one
`error:` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from models.errors import ConfigError
from trainer.flux_data.build import BuildParams, build_dataset, ensure_procedural_dataset
from trainer.runtime import cli
from trainer.runtime.atomic import WriteFailed, atomic_dir
from trainer.runtime.runlock import lock_destination


def _check_values(ns) -> None:
    """Sizes and counts in range, the dtype one of the two, before anything is built."""
    for flag, value, least in (
        ("--image-size", ns.image_size, 1),
        ("--num-train", ns.num_train, 1),
        ("--num-heldout", ns.num_heldout, 1),
        ("--text-length", ns.text_length, 1),
        ("--shard-rows", ns.shard_rows, 1),
        ("--vae-steps", ns.vae_steps, 0),
    ):
        if value < least:
            raise ConfigError(f"{flag}: {value}; allowed: an integer >= {least}")
    if ns.encoder_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--encoder-dtype: {ns.encoder_dtype!r}; allowed: float32, bfloat16")


def main(argv: list[str] | None = None) -> int:
    d = BuildParams()
    parser = cli.ArgumentParser(
        prog="build_flux_data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (must not exist); default: the cache "
        "folder the loader uses ($TITAN_CACHE/flux_data/procedural-<key>)",
    )
    parser.add_argument("--image-size", type=int, default=d.image_size)
    parser.add_argument("--num-train", type=int, default=d.num_train)
    parser.add_argument("--num-heldout", type=int, default=d.num_heldout)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--text-length", type=int, default=d.text_length, help="caption tokens S (padded)")
    parser.add_argument("--shard-rows", type=int, default=d.shard_rows)
    parser.add_argument("--vae-steps", type=int, default=d.vae_steps, help="debug VAE training steps")
    parser.add_argument("--t5", default=None, help="local T5EncoderModel folder")
    parser.add_argument("--t5-tokenizer", default=None, help="local T5 tokenizer folder (default: --t5)")
    parser.add_argument("--clip", default=None, help="local CLIPTextModel folder")
    parser.add_argument("--clip-tokenizer", default=None, help="local CLIP tokenizer folder (default: --clip)")
    parser.add_argument("--vae", default=None, help="local AutoencoderKL folder (16 latent channels)")
    parser.add_argument(
        "--encoder-dtype",
        default=d.encoder_dtype,
        help="float32 | bfloat16: dtype of local encoders and VAE (embeddings are stored as float32)",
    )
    parser.add_argument("--device", default="cpu", help="where local encoders and VAE run, e.g. cuda")
    try:
        ns = parser.parse_args(argv)
        _check_values(ns)
        params = BuildParams(
            image_size=ns.image_size,
            num_train=ns.num_train,
            num_heldout=ns.num_heldout,
            seed=ns.seed,
            text_length=ns.text_length,
            shard_rows=ns.shard_rows,
            vae_steps=ns.vae_steps,
            t5_path=ns.t5,
            clip_path=ns.clip,
            t5_tokenizer_path=ns.t5_tokenizer,
            clip_tokenizer_path=ns.clip_tokenizer,
            vae_path=ns.vae,
            encoder_dtype=ns.encoder_dtype,
        )
        if ns.out is None:
            folder = ensure_procedural_dataset(params, device=ns.device)
        else:
            if os.path.exists(ns.out):
                raise ConfigError(f"--out {ns.out}: already exists; allowed: a path that does not exist yet")
            # Built under a temporary name beside --out and renamed when complete; a second build
            # into the same --out is refused while this one runs (trainer/runtime/runlock.py).
            with lock_destination(ns.out, key="--out", who="data-set build"):
                if os.path.exists(ns.out):
                    raise ConfigError(f"--out {ns.out}: already exists; allowed: a path that does not exist yet")
                with atomic_dir(ns.out, what="FLUX data set") as tmp:
                    os.rmdir(tmp)  # build_dataset makes its folder
                    build_dataset(params, str(tmp), device=ns.device)
            folder = ns.out
        print(f"FLUX data set: {folder}")
    except ConfigError as e:
        cli.error_line(str(e))
        return 2
    except WriteFailed as e:  # disk full, file too large, permission: nothing partial left
        cli.error_line(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
