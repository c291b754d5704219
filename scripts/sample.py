#!/usr/bin/env python
"""Sample images from a trained FLUX run and write them as one PNG grid.

    python scripts/sample.py --run outputs/flux_debug --prompt "a red circle on the left" \\
        --prompt "a blue square at the top" --out samples.png
    python scripts/sample.py --run outputs/flux_debug --prompts-file prompts.txt --cfg-scale 4 --steps 30

`--run` is a training run's dump folder: its config.toml names the model, the data set (whose
text encoders and VAE encode the prompts and decode the samples) and the timestep shift; the
weights come from its newest checkpoint (or `--step N`), loaded into one unsharded fp32 model
in this process. Euler steps over the rectified-flow ODE from t = 1 to 0 with classifier-free
guidance (docs/flux_sampling.md). Prompts are laid out row-major; the sidecar `<out>.txt`
lists them in that order with their grid cells. Same seed, same images.

Exit status: 0 written, 2 invalid input (one `error:` line naming the flag or file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import ConfigError
from trainer.runtime import cli
from trainer.runtime.atomic import WriteFailed


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="scripts/sample.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", required=True, help="dump folder of a FLUX training run (holds config.toml, checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest)")
    p.add_argument("--untrained", action="store_true", help="sample the initialized, untrained model instead")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a text file, one prompt per line (blank lines skipped)")
    p.add_argument("--out", default="samples.png", help="PNG path of the grid (default samples.png)")
    p.add_argument("--steps", type=int, default=20, help="Euler steps (default 20)")
    p.add_argument(
        "--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale; 1 = conditional only (default 4)"
    )
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="guidance-embedding value of a FLUX.1-dev-style model (default: the run's flow.guidance)",
    )
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--ncols", type=int, default=None, help="grid columns (default: about sqrt(prompts))")
    p.add_argument("--scale", type=int, default=4, help="upscale each pixel to scale x scale in the PNG (default 4)")
    return p


def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
    out = list(prompts)
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {prompts_file}: no such file; allowed: a text file, one prompt per line")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError(
                f"--prompts-file {prompts_file}: cannot read as UTF-8 text ({reason}); "
                "allowed: a text file, one prompt per line"
            ) from None
        out += [line.strip() for line in text.splitlines() if line.strip()]
    if not out:
        raise ConfigError("--prompt / --prompts-file: no prompts given; allowed: at least one prompt")
    return out


def write_sidecar(path: str, prompts: list[str], *, ncols: int, header: str) -> None:
    lines = [header]
    for i, prompt in enumerate(prompts):
        r, c = divmod(i, ncols)
        lines.append(f"row {r} col {c}: {prompt}")
    from trainer.runtime.atomic import atomic_file

    with atomic_file(path, what="prompt list", mode="w") as f:
        f.write("\n".join(lines) + "\n")


def _run(argv: list[str]) -> int:
    import math

    ns = _parser().parse_args(argv)
    if ns.steps < 1:
        raise ConfigError(f"--steps: {ns.steps}; allowed: >= 1")
    if not math.isfinite(ns.cfg_scale) or ns.cfg_scale < 0:
        raise ConfigError(f"--cfg-scale: {ns.cfg_scale}; allowed: a finite number >= 0")
    if ns.guidance is not None and (not math.isfinite(ns.guidance) or ns.guidance < 0):
        raise ConfigError(f"--guidance: {ns.guidance}; allowed: a finite number >= 0")
    if ns.scale < 1 or (ns.ncols is not None and ns.ncols < 1):
        raise ConfigError("--scale / --ncols: allowed: >= 1")
    prompts = read_prompts(ns.prompt, ns.prompts_file)
    from trainer.flux_run import load_run
    from trainer.tasks.flux_sample import image_grid, sample_images, save_png

    run = load_run(ns.run, step=ns.step, untrained=ns.untrained, seed=ns.seed)
    images = sample_images(
        run.model,
        prompts,
        text=run.text,
        vae=run.vae,
        latent_shape=run.latent_shape,
        seed=ns.seed,
        num_steps=ns.steps,
        shift=run.shift,
        cfg_scale=ns.cfg_scale,
        guidance=run.guidance(ns.guidance),
    )
    ncols = ns.ncols or math.ceil(math.sqrt(len(prompts)))
    grid = image_grid(images, ncols=ncols)
    from trainer.runtime.atomic import atomic_path

    with atomic_path(ns.out, what="sample grid") as tmp:  # a failed write leaves no partial PNG at --out
        save_png(grid, str(tmp), scale=ns.scale)
    source = run.checkpoint or "untrained (initialized) model"
    sidecar = str(Path(ns.out).with_suffix(".txt"))
    write_sidecar(
        sidecar,
        prompts,
        ncols=ncols,
        header=f"# {source}; steps {ns.steps}, cfg_scale {ns.cfg_scale}, shift {run.shift:.3f}, "
        f"guidance {run.guidance(ns.guidance)}, seed {ns.seed}",
    )
    print(
        f"wrote {ns.out} ({len(prompts)} images, {grid.shape[2] * ns.scale}x{grid.shape[1] * ns.scale} px) "
        f"and {sidecar}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        cli.error_line(str(e))
        return 2
    except WriteFailed as e:  # disk full, file too large, permission: nothing partial at --out
        cli.error_line(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
