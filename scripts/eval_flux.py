#!/usr/bin/env python
"""Held-out prompt evaluation of a FLUX run: does the model draw what a new prompt asks for?

    python scripts/eval_flux.py --run outputs/flux_debug
    python scripts/eval_flux.py --run outputs/flux_debug --samples-per-prompt 8 --cfg-scale 4 --csv eval.csv

The procedural data set (trainer/flux_data/build.py) holds out 12 (colour, shape, position)
combinations from training; every colour, shape and position, and every pair, is still
trained. For each held-out caption ("a cyan square at the top") this samples
`--samples-per-prompt` images from the run's checkpoint and from the same model untrained
(initialized with the same seed, never stepped), reads each image's dominant colour and
position from its pixels with the data set's classifier (`trainer.flux_data.build.classify`, the same
one that checks the training captions against their pixels), and prints how often they match
the prompt: colour %, position %, both %; chance is 1/6 for colour and 1/5 for position.

Writes a CSV with one row per image (model, prompt, attributes, what was read back, matches)
and a PNG grid per model (one row per prompt, one column per sample; the sidecar .txt lists
the rows). Sampling is deterministic in --seed. Exit status: 0 done, 2 invalid input.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from models.errors import ConfigError
from trainer.runtime import cli
from trainer.runtime.atomic import WriteFailed

CHANCE = {"colour": 1 / 6, "position": 1 / 5}


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="scripts/eval_flux.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", required=True, help="dump folder of a FLUX training run on the procedural data set")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="images per held-out prompt (default 4)")
    p.add_argument("--steps", type=int, default=20, help="Euler steps (default 20)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale (default 4)")
    p.add_argument("--seed", type=int, default=0, help="noise seed, and the untrained model's init seed (default 0)")
    p.add_argument("--csv", default=None, help="per-image CSV (default <run>/eval_heldout.csv)")
    p.add_argument(
        "--grid",
        default=None,
        help="PNG grid of the trained model (default <run>/eval_heldout.png; "
        "the untrained one next to it, suffix _untrained)",
    )
    return p


def heldout_prompts(dataset) -> list[dict]:
    """One {caption, colour, shape, position} per held-out combination, in data set order."""
    seen, out = set(), []
    for row in dataset.captions("heldout"):
        key = (row["colour"], row["shape"], row["position"])
        if key not in seen:
            seen.add(key)
            out.append({k: row[k] for k in ("caption", "colour", "shape", "position")})
    return out


def evaluate(run, prompts: list[dict], *, samples: int, steps: int, cfg_scale: float, seed: int):
    """(images [P * samples, 3, H, W], rows): row-major by prompt, one row per image."""
    from trainer.flux_data.build import classify
    from trainer.tasks.flux_sample import sample_images

    captions = [p["caption"] for p in prompts for _ in range(samples)]
    images = sample_images(
        run.model,
        captions,
        text=run.text,
        vae=run.vae,
        latent_shape=run.latent_shape,
        seed=seed,
        num_steps=steps,
        shift=run.shift,
        cfg_scale=cfg_scale,
        guidance=run.guidance(),
    )
    rows = []
    for i, (colour, position) in enumerate(classify(images)):
        p = prompts[i // samples]
        rows.append(
            {
                **p,
                "sample": i % samples,
                "read_colour": colour or "",
                "read_position": position or "",
                "colour_ok": int(colour == p["colour"]),
                "position_ok": int(position == p["position"]),
            }
        )
    return images, rows


def summary(rows: list[dict]) -> dict:
    n = len(rows)
    return {
        "images": n,
        "colour": sum(r["colour_ok"] for r in rows) / n,
        "position": sum(r["position_ok"] for r in rows) / n,
        "both": sum(r["colour_ok"] and r["position_ok"] for r in rows) / n,
    }


def table(results: dict[str, dict]) -> str:
    lines = [f"{'model':<26} {'images':>6} {'colour %':>9} {'position %':>11} {'both %':>7}"]
    for name, s in results.items():
        lines.append(
            f"{name:<26} {s['images']:>6} {100 * s['colour']:>9.1f} {100 * s['position']:>11.1f} "
            f"{100 * s['both']:>7.1f}"
        )
    lines.append(
        f"{'chance':<26} {'':>6} {100 * CHANCE['colour']:>9.1f} {100 * CHANCE['position']:>11.1f} "
        f"{100 * CHANCE['colour'] * CHANCE['position']:>7.1f}"
    )
    return "\n".join(lines)


def _run(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    if ns.samples_per_prompt < 1 or ns.steps < 1:
        raise ConfigError("--samples-per-prompt / --steps: allowed: >= 1")
    if not math.isfinite(ns.cfg_scale) or ns.cfg_scale < 0:
        raise ConfigError(f"--cfg-scale: {ns.cfg_scale}; allowed: a finite number >= 0")
    from scripts.sample import write_sidecar
    from trainer.flux_run import load_run
    from trainer.runtime.atomic import atomic_file, atomic_path
    from trainer.tasks.flux_sample import image_grid, save_png

    trained = load_run(ns.run, step=ns.step, seed=ns.seed)
    untrained = load_run(ns.run, untrained=True, seed=ns.seed)
    prompts = heldout_prompts(trained.dataset)
    run_dir = Path(ns.run)
    csv_path = Path(ns.csv) if ns.csv else run_dir / "eval_heldout.csv"
    grid_path = Path(ns.grid) if ns.grid else run_dir / "eval_heldout.png"
    step_name = Path(trained.checkpoint).name
    results, all_rows = {}, []
    for name, run, png in (
        (f"trained ({step_name})", trained, grid_path),
        ("untrained (init)", untrained, grid_path.with_name(grid_path.stem + "_untrained.png")),
    ):
        images, rows = evaluate(
            run, prompts, samples=ns.samples_per_prompt, steps=ns.steps, cfg_scale=ns.cfg_scale, seed=ns.seed
        )
        results[name] = summary(rows)
        all_rows += [{"model": name, **r} for r in rows]
        with atomic_path(png, what="evaluation grid") as tmp:  # a failed write leaves no partial PNG
            save_png(image_grid(images, ncols=ns.samples_per_prompt), str(tmp), scale=4)
        write_sidecar(
            str(png.with_suffix(".txt")),
            [p["caption"] for p in prompts for _ in range(ns.samples_per_prompt)],
            ncols=ns.samples_per_prompt,
            header=f"# {name}: {run.checkpoint or 'initialized model'}",
        )
    with atomic_file(csv_path, what="evaluation table", mode="w") as f:
        writer = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        writer.writeheader()
        writer.writerows(all_rows)
    print(
        f"held-out prompts: {len(prompts)} (never trained), {ns.samples_per_prompt} samples each; "
        f"{ns.steps} Euler steps, cfg_scale {ns.cfg_scale}, seed {ns.seed}"
    )
    print(table(results))
    print(f"wrote {csv_path}, {grid_path} (+ _untrained)")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        cli.error_line(str(e))
        return 2
    except WriteFailed as e:  # disk full, file too large, permission: nothing partial at the destination
        cli.error_line(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
