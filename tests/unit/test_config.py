"""Config parsing, precedence, CLI overrides, and every user-error path (exit 2, one `error:` line)."""

import glob
import os
import subprocess
import sys

import pytest
import torch

from trainer.config import ConfigError, build_config, resolve_model_args, split_cli, to_toml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


def write(tmp_path, text, name="r.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    recipe = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    cfg = build_config(recipe, [("training.steps", "9")])
    assert cfg.training.steps == 9  # CLI wins
    assert cfg.training.seq_len == 64  # TOML wins over default
    assert cfg.optimizer.lr == 0.01
    assert cfg.training.local_batch_size == 8  # default


def test_cli_forms():
    recipe, printcfg, ov = split_cli(
        ["--config", "a.toml", "--training.steps=3", "--optimizer.lr", "0.5", "--print-config"]
    )
    assert recipe == "a.toml" and printcfg
    assert ov == [("training.steps", "3"), ("optimizer.lr", "0.5")]
    cfg = build_config(None, ov + [("optimizer.betas", "[0.8, 0.99]"), ("compile.scan_layers", "false")])
    assert cfg.optimizer.lr == 0.5 and cfg.optimizer.betas == [0.8, 0.99]


def test_model_overrides_apply_to_flavor_args():
    cfg = build_config(None, [("model.n_layers", "3"), ("training.seq_len", "64")])
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    assert args.n_layers == 3
    with pytest.raises(ConfigError, match="model.n_layer"):
        resolve_model_args(build_config(None, [("model.n_layer", "3")]).model, seq_len=64)
    with pytest.raises(ConfigError, match="model.n_layers: expected an integer"):
        resolve_model_args(build_config(None, [("model.n_layers", "many")]).model, seq_len=64)
    with pytest.raises(ConfigError, match="model.flavor"):
        resolve_model_args(build_config(None, [("model.flavor", "9000B")]).model, seq_len=64)
    with pytest.raises(ConfigError, match="model.name"):
        resolve_model_args(build_config(None, [("model.name", "gpt5")]).model, seq_len=64)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ([("trainin.steps", "3")], r"unknown section \[trainin\].*did you mean training"),
        ([("training.stpes", "3")], r"unknown key training.stpes.*did you mean training.steps"),
        ([("training.steps", "x")], r"training.steps: expected an integer"),
        ([("training.steps", "0")], r"training.steps: 0 is out of range"),
        ([("optimizer.lr", "-1")], r"optimizer.lr: .* out of range"),
        ([("compile.mode", "fast")], r"compile.mode: 'fast' is not allowed; allowed: eager, compile, graph"),
        ([("optimizer.betas", "[0.9]")], r"optimizer.betas"),
        ([("checkpoint.enable", "maybe")], r"checkpoint.enable: expected true or false"),
        ([("parallelism.data_parallel_shard_degree", "0")], r"data_parallel_shard_degree"),
    ],
)
def test_bad_values(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_config(None, overrides)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        build_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="invalid TOML"):
        build_config(write(tmp_path, "[training\nsteps = 1"))
    with pytest.raises(ConfigError, match="unknown key job.dump_foldr"):
        build_config(write(tmp_path, "[job]\ndump_foldr = 'x'\n"))


def test_print_config_round_trips(tmp_path):
    cfg = build_config(None, [("training.steps", "11"), ("model.n_layers", "2")])
    again = build_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_recipe_parses_and_builds_on_meta(recipe):
    cfg = build_config(recipe)
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        model = family.model_cls(args)
    n = sum(p.numel() for p in model.parameters())
    assert n == args.num_params()


def run_cli(*argv, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--config", "configs/nope.toml"], "configs/nope.toml"),
        (["--config", "configs/llama3_debug.toml", "--training.stpes=3"], "training.steps"),
        (["--config", "configs/llama3_debug.toml", "--training.dataset=/nonexistent/*.jsonl"], "/nonexistent"),
        (["--config", "configs/llama3_debug.toml", "--model.tokenizer=/nonexistent.model"], "/nonexistent.model"),
        (["--config", "configs/llama3_debug.toml", "--parallelism.tensor_parallel_degree=3"], "tensor_parallel_degree"),
        (["--config", "configs/llama3_debug.toml", "--model.attn_backend=flash"], "model.attn_backend"),
        (["--config", "configs/llama3_debug.toml", "--model.n_layers=0"], "model.n_layers"),
        (["--bogus"], "unrecognized argument"),
        (["--config", "configs/llama3_debug.toml", "--checkpoint.local_folder=ckpt"], "checkpoint.local_folder"),
        (["--config", "configs/llama3_debug.toml", "--checkpoint.local_interval=0"], "checkpoint.local_interval"),
        (["--config", "configs/llama3_debug.toml", "--training.collective_timeout_s=0"], "collective_timeout_s"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, argv, needle):
    r = run_cli(*argv, f"--job.dump_folder={tmp_path}/out" if argv[0] == "--config" else "--print-config")
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_print_config_cli():
    r = run_cli("--config", "configs/llama3_debug.toml", "--training.steps=5", "--print-config")
    assert r.returncode == 0, r.stderr
    assert "steps = 5" in r.stdout and "[parallelism]" in r.stdout


def test_config_docs_are_current():
    r = subprocess.run([sys.executable, "scripts/dev/gen_config_docs.py", "--check"], cwd=ROOT)
    assert r.returncode == 0, "docs/config.md is stale: run python scripts/dev/gen_config_docs.py"


# ----------------------------------------------------------- one type check for every override


def _union_fields():
    """(family, field, non-None type) for every optional/union field of every model family's args."""
    import dataclasses
    import types
    import typing

    from models import FAMILIES, get_model_family

    out = []
    for name in FAMILIES:
        family = get_model_family(name)
        hints = typing.get_type_hints(family.args_cls)
        for f in dataclasses.fields(family.args_cls):
            if typing.get_origin(hints[f.name]) in (typing.Union, types.UnionType):
                (inner,) = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
                out.append(pytest.param(name, f.name, inner, id=f"{name}.{f.name}"))
    return out


UNION_FIELDS = _union_fields()
# A valid value of each inner type for the debug flavors (n_kv_heads must divide n_heads = 16).
GOOD = {int: ("4", 4), float: ("1.5", 1.5)}


def test_union_fields_are_found():
    # The parametrization below must not go empty silently.
    ids = {p.id for p in UNION_FIELDS}
    assert {
        "llama3.n_kv_heads",
        "llama3.hidden_dim",
        "llama3.ffn_dim_multiplier",
        "llama3.rope_scaling_factor",
    } <= ids, ids


@pytest.mark.parametrize("name, field, inner", UNION_FIELDS)
def test_optional_model_fields_are_type_checked(name, field, inner):
    base = [("model.name", name), ("training.seq_len", "64")]
    raw, value = GOOD[inner]
    _, args = resolve_model_args(build_config(None, base + [(f"model.{field}", raw)]).model, seq_len=64)
    assert getattr(args, field) == value and type(getattr(args, field)) is inner
    for none in ("none", "None"):
        _, args = resolve_model_args(build_config(None, base + [(f"model.{field}", none)]).model, seq_len=64)
        assert getattr(args, field) is None
    bad = ["abc", "true", "[1, 2]"] + (["2.5"] if inner is int else [])
    for raw in bad:
        cfg = build_config(None, base + [(f"model.{field}", raw)])
        with pytest.raises(ConfigError, match=rf"^model\.{field}: expected .* or none, got "):
            resolve_model_args(cfg.model, seq_len=64)


@pytest.mark.parametrize("field", ["rope_scaling_factor", "n_kv_heads", "hidden_dim", "ffn_dim_multiplier"])
def test_wrong_typed_optional_field_exits_2_on_the_cli(tmp_path, field):
    r = run_cli("--config", "configs/llama3_debug.toml", f"--model.{field}=abc", f"--job.dump_folder={tmp_path}/out")
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    kind = f"{'an integer' if field in ('n_kv_heads', 'hidden_dim') else 'a number'} or none"
    assert lines == [f"error: model.{field}: expected {kind}, got 'abc'; allowed: {kind}"], r.stderr
    assert not (tmp_path / "out").exists()


def test_string_fields_and_the_scripts_share_the_trainer_type_check():
    from trainer.config import coerce, model_args, parse_value

    assert coerce("model.tokenizer", parse_value("bundled"), str) == "bundled"  # strings pass
    assert coerce("k", 3, int | str) == 3 and coerce("k", "x", int | str) == "x"
    with pytest.raises(ConfigError, match="model.n_layers: expected an integer, got '2'"):
        model_args("llama3", "debugmodel", {"n_layers": "2"})


def test_documented_model_names_are_accepted():
    # docs once listed qwen3_moe as a model name; the CLI rejects it (it is a qwen3 flavor).
    import re

    from models import FAMILIES
    from trainer.config import field_docs

    doc = dict((k, d) for k, _, d in field_docs()["model"])["name"]
    listed = re.match(r"Model family: (\w+(?: \| \w+)*)", doc).group(1).split(" | ")
    assert listed == list(FAMILIES)
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert "qwen3_moe." not in f.read()


def test_local_tier_folder_is_an_absolute_host_path():
    """checkpoint.local_folder: each host's own disk, so absolute and never gs:// (one error line
    naming the key; docs/checkpointing.md, "Multi-tier checkpoints")."""
    base = "configs/llama3_debug.toml"
    for bad in ("ckpt/local", "gs://bucket/local"):
        with pytest.raises(ConfigError, match=r"^checkpoint.local_folder: .*allowed: an absolute path"):
            build_config(base, [("checkpoint.local_folder", bad)])
    cfg = build_config(base, [("checkpoint.local_folder", "/mnt/local-ssd/ckpt"), ("checkpoint.local_interval", "10")])
    assert (cfg.checkpoint.local_folder, cfg.checkpoint.local_interval) == ("/mnt/local-ssd/ckpt", 10)


def test_a_list_of_names_takes_one_name_and_its_error_shows_names():
    """`--quantize.filter_fqns=output` is the list ["output"]; a list of names refused shows a list
    of names as its form (it showed [0.9, 0.95], the betas' example, for every list)."""
    assert build_config(None, [("quantize.filter_fqns", "output")]).quantize.filter_fqns == ["output"]
    assert build_config(None, [("quantize.filter_fqns", "output,layers.0")]).quantize.filter_fqns == [
        "output",
        "layers.0",
    ]
    with pytest.raises(ConfigError, match=r'^optimizer\.muon_exclude: expected a list such as \["output"'):
        build_config(None, [("optimizer.muon_exclude", "{a = 1}")])
    with pytest.raises(ConfigError, match=r"^optimizer\.betas: expected a list such as \[0\.9, 0\.95\]"):
        build_config(None, [("optimizer.betas", "x")])
