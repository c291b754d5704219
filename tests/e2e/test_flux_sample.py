"""FLUX sampling (trainer/tasks/flux_sample.py, scripts/sample.py) and the held-out eval (scripts/eval_flux.py).

The sampler is checked exactly where the answer is known in closed form: if every sample of the
data were one latent x0, the rectified-flow velocity at x_t is v = (x_t - x0) / t, and an Euler
step x + (t' - t) v = x0 + (x - x0) t'/t lands on the same straight line, so any schedule reaches
x0 exactly at t = 0. With classifier-free guidance and different targets for the conditional
and unconditional branches, the guided field's endpoint is x0_u + s (x0_c - x0_u). The bound is
fp32 rounding: each of <= 20 steps adds a few ulps of |x| ~ 4, so 1e-5 absolute.

The script tests run on a tiny run folder built here: a procedural data set with 16 px images
(4 x 4 latents, VAE trained 2 steps), a 1 + 1 block FLUX at hidden 64, and a DCP checkpoint
of its (perturbed) weights saved as the trainer saves them (`{"model": state_dict}`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainer import flux_run
from trainer.tasks import flow
from trainer.tasks import flux_sample as fs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PointMassFlow(torch.nn.Module):
    """The exact velocity of a data set that is one latent: x0_c with text, x0_u without (zeros)."""

    def __init__(self, x0_c: torch.Tensor, x0_u: torch.Tensor):
        super().__init__()
        from models.flux.latents import pack

        self.register_buffer("c", pack(x0_c))
        self.register_buffer("u", pack(x0_u))
        self.w = torch.nn.Parameter(torch.zeros(()))  # sample_images reads a parameter's device
        self.seen_guidance = []

    def forward(self, img, img_ids, txt, txt_ids, t, y, guidance=None):
        self.seen_guidance.append(guidance)
        uncond = (txt.abs().sum(dim=(1, 2)) == 0)[:, None, None]
        n = img.shape[0]
        target = torch.where(uncond, self.u[:1].expand(n, -1, -1), self.c[:1].expand(n, -1, -1))
        return (img - target) / t[:, None, None]


@pytest.mark.parametrize("shift,steps", [(1.0, 1), (1.0, 7), (3.0, 20)])
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_euler_cfg_reaches_the_exact_endpoint(shift, steps, cfg_scale):
    g = torch.Generator().manual_seed(0)
    x0_c, x0_u = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 16, 4, 6, generator=g)
    model = PointMassFlow(x0_c, x0_u)
    noise = torch.randn(3, 16, 4, 6, generator=g)
    t5, clip = torch.randn(3, 5, 8, generator=g), torch.randn(3, 8, generator=g)
    out = fs.euler_sample(model, noise, t5, clip, num_steps=steps, shift=shift, cfg_scale=cfg_scale, guidance=3.5)
    want = (x0_u + cfg_scale * (x0_c - x0_u)).expand_as(out)
    assert (out - want).abs().max().item() <= 1e-5
    # One batched forward per step (cond + uncond together when guided), guidance fed to each.
    assert len(model.seen_guidance) == steps
    assert all(float(gv[0]) == 3.5 and len(gv) == (6 if cfg_scale != 1 else 3) for gv in model.seen_guidance)


def test_step_times_use_the_training_shift():
    t = fs.step_times(10, shift=3.0)
    assert t[0] == 1 and t[-1] == 0 and bool((t[1:] < t[:-1]).all())
    torch.testing.assert_close(t, flow.shift_timesteps(torch.linspace(1, 0, 11), 3.0), rtol=0, atol=1e-7)
    assert torch.equal(fs.step_times(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_noise_depends_only_on_seed_and_position():
    a = fs.initial_noise(4, (16, 2, 2), seed=5)
    b = fs.initial_noise(2, (16, 2, 2), seed=5, first=2)
    assert torch.equal(a[2:], b) and not torch.equal(a[0], a[1])
    assert not torch.equal(a, fs.initial_noise(4, (16, 2, 2), seed=6))


def test_image_grid_layout():
    images = torch.stack([torch.full((3, 4, 5), i / 10) for i in range(5)])
    grid = fs.image_grid(images, ncols=3, pad=1)
    assert grid.shape == (3, 2 * (4 + 1) + 1, 3 * (5 + 1) + 1)
    assert float(grid[0, 1, 1]) == 0.0 and abs(float(grid[0, 6, 7]) - 0.4) < 1e-7  # image 4: row 1, col 1
    assert float(grid[0, 0, 0]) == 1.0  # padding


# --- a tiny run folder ----------------------------------------------------------------------
MODEL_OVERRIDES = dict(hidden_size=64, num_heads=1, depth=1, depth_single_blocks=1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainer.config import model_args
    from trainer.flux_data import build as fb

    root = tmp_path_factory.mktemp("flux_run")
    data = str(root / "data")
    fb.build_dataset(
        fb.BuildParams(image_size=16, num_train=24, num_heldout=12, shard_rows=24, row_group_rows=8, vae_steps=2),
        data,
        log=lambda _: None,
    )
    run = root / "run"
    run.mkdir()
    overrides = "\n".join(f"{k} = {v}" for k, v in MODEL_OVERRIDES.items())
    (run / "config.toml").write_text(
        f'[job]\ndump_folder = "{run}"\n[model]\nname = "flux"\nflavor = "debugmodel"\n{overrides}\n'
        f'[training]\ndataset = "{data}"\n[flow]\nshift = 2.0\n'
    )
    family, args = model_args("flux", "debugmodel", MODEL_OVERRIDES)
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        model.init_weights()
        for p in model.parameters():  # "trained": every weight moved off its init (adaLN gates too)
            p.add_(0.05 * torch.randn_like(p))
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(run / "checkpoints" / "step-3"))
    return run, model


def test_load_run_restores_the_checkpoint(tiny_run):
    run_dir, saved = tiny_run
    run = flux_run.load_run(str(run_dir))
    assert run.checkpoint.endswith("step-3") and run.shift == 2.0 and run.guidance() is None
    want = saved.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in run.model.state_dict().items())
    init = flux_run.load_run(str(run_dir), untrained=True)
    assert init.checkpoint is None and not torch.equal(init.model.img_in.weight, saved.img_in.weight)


def test_log_sample_grid_is_deterministic(tiny_run):
    run = flux_run.load_run(str(tiny_run[0]))
    kw = dict(text=run.text, vae=run.vae, latent_shape=run.latent_shape, num_steps=2, shift=run.shift, seed=3)
    prompts = ["a red circle on the left", "a blue square at the top", "a white diamond in the center"]
    grid = fs.log_sample_grid(run.model, prompts, ncols=3, **kw)
    side = run.dataset.meta["params"]["image_size"]  # 16: one row of three images, padding 2
    assert grid.shape == (3, side + 4, 3 * (side + 2) + 2) and grid.dtype == torch.float32
    assert 0 <= float(grid.min()) and float(grid.max()) <= 1
    assert torch.equal(grid, fs.log_sample_grid(run.model, prompts, ncols=3, **kw))
    assert not torch.equal(grid, fs.log_sample_grid(run.model, prompts, ncols=3, **{**kw, "seed": 4}))


def _script(name, *args):
    """Run `scripts/<name>` as a process (exit code, one-line stderr, no traceback)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def _main(module, capsys, *args):
    """`module.main(args)` in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    import importlib

    code = importlib.import_module(f"scripts.{module}").main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sample_script_writes_png_grid(tiny_run, tmp_path, capsys):
    from PIL import Image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on the left\n\na green triangle on the right\na cyan square at the top\n")
    out = tmp_path / "grid.png"
    code, _, err = _main(
        "sample",
        capsys,
        "--run",
        str(tiny_run[0]),
        "--prompts-file",
        str(prompts),
        "--prompt",
        "a blue diamond",
        "--steps",
        "2",
        "--cfg-scale",
        "3",
        "--out",
        str(out),
        "--scale",
        "2",
    )
    assert code == 0, err
    image = Image.open(out)
    side = 16  # image_size of the tiny data set
    assert image.mode == "RGB" and image.size == (2 * (2 * (side + 2) + 2), 2 * (2 * (side + 2) + 2))
    lines = (tmp_path / "grid.txt").read_text().splitlines()
    assert "step-3" in lines[0] and lines[1:] == [
        "row 0 col 0: a blue diamond",
        "row 0 col 1: a red circle on the left",
        "row 1 col 0: a green triangle on the right",
        "row 1 col 1: a cyan square at the top",
    ]


def test_sample_script_bad_input(tiny_run, tmp_path, capsys):
    for args, key in (
        (["--run", str(tmp_path), "--prompt", "x"], "config.toml"),
        (["--run", str(tiny_run[0])], "--prompt"),
        (["--run", str(tiny_run[0]), "--prompt", "x", "--step", "9"], "--step 9"),
        (["--run", str(tiny_run[0]), "--prompts-file", str(tmp_path / "none.txt")], "--prompts-file"),
        (["--run", str(tiny_run[0]), "--prompt", "x", "--steps", "0"], "--steps"),
    ):
        code, _, err = _main("sample", capsys, *args)
        assert code == 2 and err.startswith("error: ") and key in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_sample_script_bad_input_as_a_process(tmp_path):
    """As a process (interpreter start-up + imports: slow on shared cores): exit status 2, one
    `error:` line, no traceback."""
    r = _script("sample.py", "--run", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "config.toml" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_eval_flux_runs_on_a_tiny_checkpoint(tiny_run, tmp_path, capsys):
    import csv

    out = tmp_path / "eval.csv"
    code, stdout, err = _main(
        "eval_flux",
        capsys,
        "--run",
        str(tiny_run[0]),
        "--samples-per-prompt",
        "2",
        "--steps",
        "2",
        "--csv",
        str(out),
        "--grid",
        str(tmp_path / "eval.png"),
    )
    assert code == 0, err
    assert "trained (step-3)" in stdout and "untrained (init)" in stdout and "chance" in stdout
    rows = list(csv.DictReader(open(out)))
    from trainer.flux_data.build import HELDOUT_COMBOS

    assert len(rows) == 2 * len(HELDOUT_COMBOS) * 2
    assert {(r["colour"], r["shape"], r["position"]) for r in rows} == set(HELDOUT_COMBOS)
    assert all(r["colour_ok"] == str(int(r["read_colour"] == r["colour"])) for r in rows)
    assert (tmp_path / "eval.png").is_file() and (tmp_path / "eval_untrained.png").is_file()


def test_eval_flux_disk_full_leaves_nothing_partial(tiny_run, tmp_path, capsys, monkeypatch):
    """A write that fails (ENOSPC injected into the PNG writer after it wrote a partial file) is one
    `error:` line with the errno text, exit 1, and leaves no file and no temporary at the outputs."""
    import errno

    from trainer.tasks import flux_sample

    real = flux_sample.save_png

    def failing_save_png(grid, path, **kw):
        real(grid, path, **kw)  # a partial output exists when the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(flux_sample, "save_png", failing_save_png)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = _main(
        "eval_flux",
        capsys,
        "--run",
        str(tiny_run[0]),
        "--samples-per-prompt",
        "1",
        "--steps",
        "1",
        "--csv",
        str(out_dir / "eval.csv"),
        "--grid",
        str(out_dir / "eval.png"),
    )
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (transformers' load bars also print)
    assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in err
    assert list(out_dir.iterdir()) == []
