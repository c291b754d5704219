"""The bad-input contract on every entry point (docs/testing.md, "Contract test").

For each entry point (a row of ROWS) and each class of bad input (tests/support/contract_inputs.py:
missing, unreadable, binary, malformed, truncated, wrong type, non-finite, out of range,
inconsistent, occupied destination), cases are generated from one valid input by a damage
function. Each case must give exit status 2, exactly one line on stderr, starting `error:` and
naming the damaged key, flag or file, no traceback, and leave what the entry point writes (its
dump folder, output path, destination) as it was.

The valid inputs are built once (a tiny tokenizer.json, an HF config.json with its safetensors,
a DCP checkpoint, a FLUX data set folder and a FLUX run folder). The cases run in one runner
process that imports torch once and forks a child per case (`contract_inputs.run_cases`): the
child runs the script as `python script.py ...` would, so the exit status and stderr are the
real ones. `test_runner_matches_a_real_process` checks that against real subprocesses.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import tomllib

from tests.support import contract_inputs as ci

ROOT = ci.ROOT
PY = sys.executable
ENGINE = (
    "import sys\nfrom models.errors import ConfigError\nfrom trainer.engine import Engine\n"
    "try:\n    Engine.from_recipe(sys.argv[1])\nexcept ConfigError as e:\n"
    "    print(f'error: {e}', file=sys.stderr)\n    sys.exit(2)\n"
)
"""The engine's contract is an exception: `Engine.from_recipe` raises ConfigError (one line) for
bad input; this snippet is how a caller turns it into the command-line contract."""


# --------------------------------------------------------------------------------- valid inputs


def _recipe(name: str, work: str, **sections) -> dict:
    with open(os.path.join(ROOT, "configs", name), "rb") as f:
        data = tomllib.load(f)
    data["job"]["dump_folder"] = os.path.join(work, "dump")
    data["training"].update(steps=1, local_batch_size=2)
    data["metrics"]["enable_tensorboard"] = False
    data["validation"]["enable"] = False
    if "flow" in data:  # the keys the cases damage, at their defaults
        data["flow"].update(shift=1.0, guidance=1.0, cfg_scale=4.0)
    for section, table in sections.items():
        data.setdefault(section, {}).update(table)
    return data


def _tokenizer_json(path: str) -> None:
    """A byte-level BPE tokenizer.json (GPT-2 layout) trained by `tokenizers` on a few lines."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    tok.save(path)


def _hf_folder(path: str) -> None:
    """config.json + model.safetensors of a tiny random Llama (tests/support/hf_configs.py sizes)."""
    import torch
    import transformers

    from tests.support.hf_configs import CONFIGS

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIGS["llama"].items() if k != "model_type"})
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def _dcp_checkpoint(path: str) -> None:
    """A DCP checkpoint of the Llama 3 debug model with 1 layer (keys `model.<param>`)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.config import model_args

    family, args = model_args("llama3", "debugmodel", {"n_layers": 1})
    torch.manual_seed(0)
    model = family.model_cls(args)
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=path, no_dist=True)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """The valid inputs every case is generated from (paths under one folder)."""
    from trainer.flux_data import build as fb

    base = str(tmp_path_factory.mktemp("contract"))
    v = {"base": base}
    v["tokenizer"] = os.path.join(base, "tokenizer.json")
    _tokenizer_json(v["tokenizer"])
    v["hf"] = os.path.join(base, "hf")
    _hf_folder(v["hf"])
    v["dcp"] = os.path.join(base, "dcp", "step-1")
    _dcp_checkpoint(v["dcp"])
    v["flux_data"] = os.path.join(base, "flux_data")
    fb.build_dataset(
        fb.BuildParams(num_train=32, num_heldout=12, shard_rows=16, row_group_rows=8, vae_steps=1),
        v["flux_data"],
        log=lambda _: None,
    )
    v["flux_run"] = os.path.join(base, "flux_run")
    os.makedirs(v["flux_run"])
    run_recipe = _recipe("flux_debug.toml", base, training={"dataset": v["flux_data"]})
    run_recipe["job"]["dump_folder"] = v["flux_run"]
    ci.write_toml(os.path.join(v["flux_run"], "config.toml"), run_recipe)
    v["prompts"] = os.path.join(base, "prompts.txt")
    with open(v["prompts"], "w") as f:
        f.write("a red circle on the left\n")
    return v


# --------------------------------------------------------------------------------- the table
#
# A row: entry point -> the cases of its inputs. Each generator gets a fresh case folder
# (`work`, a copy of nothing) and the valid inputs, and yields (class, label, argv, names,
# watch, prepare): `prepare()` builds the damaged input inside `work`.


def _copy(src: str, dst: str) -> str:
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(src, dst)
    return dst


def recipe_cases(recipe: dict, keys: list, *, file_damage: bool = True):
    """Cases of a TOML recipe: the file's damages, then each key's (`ci.damage_data`).
    Yields (class, label, write(work) -> recipe path, names)."""

    def write_valid_then(apply):
        def write(work):
            path = os.path.join(work, "recipe.toml")
            ci.write_toml(path, _in(work, recipe))
            apply(path)
            return path

        return write

    if file_damage:
        for cls, label, apply in ci.damage_file("recipe.toml", fmt="toml"):
            yield cls, label, write_valid_then(_rebind(apply)), ["recipe.toml"]
    for cls, label, data in ci.damage_data(recipe, keys):

        def write(work, data=data):
            path = os.path.join(work, "recipe.toml")
            ci.write_toml(path, _in(work, data))
            return path

        key = label.split("=")[0]
        yield cls, label, write, [key, key.split(".")[-1]]


def _rebind(apply):
    """damage_file's closures act on the path they were made for; re-make them per case path."""
    return _rebind_as(apply, None)


def _in(work: str, data: dict) -> dict:
    """The recipe with its dump folder moved into the case folder."""
    data = copy.deepcopy(data)
    if "job" in data and isinstance(data["job"], dict) and isinstance(data["job"].get("dump_folder"), str):
        data["job"]["dump_folder"] = os.path.join(work, "dump")
    return data


def cli_cases(flags: dict[str, object]):
    """Cases of command-line values: each flag's valid value damaged (`ci.value_damages`)."""
    for flag, good in flags.items():
        only = None
        if isinstance(good, tuple):
            good, only = good
        for cls, label, bad in ci.value_damages(good):
            if only is None or cls in only:
                yield cls, f"{flag}={label}", flag, str(bad)


# Keys of the LM recipe damaged for the trainer, the engine and the planner scripts.
LM_KEYS = [
    ("training", "steps"),
    ("optimizer", "lr"),
    (("optimizer", "weight_decay"), ("wrong_type", "non_finite")),
    ("model", "flavor"),
    ("parallelism",),
]
FLOW_KEYS = [
    (("flow", "logit_mean"), ("wrong_type", "non_finite")),
    ("flow", "shift"),
    ("flow", "guidance"),
    ("flow", "cfg_scale"),
]
# A JSON file's keys and the classes that fit each.
HF_KEYS = [
    ("hidden_size",),
    ("num_attention_heads",),
    ("model_type",),
    (("rms_norm_eps",), ("wrong_type", "non_finite", "out_of_range")),
    (("rope_parameters", "rope_theta"), ("wrong_type", "non_finite", "out_of_range")),
    (("num_key_value_heads",), [("inconsistent", "heads=3", 3)]),
    (("vocab_size",), [("inconsistent", "below-tokenizer", 100)]),
]


def _json_cases(src: str, keys: list):
    """(class, label, apply(path), names) for a JSON file: the file's damages and its keys'."""
    with open(src) as f:
        data = json.load(f)
    name = os.path.basename(src)
    for cls, label, apply in ci.damage_file(src, fmt="json"):
        yield cls, label, _rebind(apply), [name]
    for cls, label, bad in ci.damage_data(data, keys):
        key = label.split("=")[0].split(".")[-1]
        yield cls, label, (lambda path, bad=bad: ci.write_json(path, bad)), [key, name]


def _tokenizer_keys(v) -> list:
    with open(v["tokenizer"]) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[260:262]
    dup = [("inconsistent", "two-tokens-one-id", vocab[a])]  # b's id becomes a's
    eos_dup = [("inconsistent", "special-id-of-a-token", vocab[a])]
    return [
        (("model", "vocab", b), dup),
        (("added_tokens", 1, "id"), eos_dup),
        ("model", "vocab"),
        (("model", "merges"), [("wrong_type", "int", 7)]),
        (("added_tokens",), [("wrong_type", "int", 7)]),
        (("model", "vocab", b), [("wrong_type", "str", "x"), ("out_of_range", "neg", -1)]),
    ]


def rows(v) -> dict[str, list[ci.Case]]:
    """entry point -> its cases, all generated from the valid inputs in `v`."""
    out: dict[str, list] = collections.defaultdict(list)
    base = v["base"]
    counter = iter(range(10**6))

    def work_dir():
        d = os.path.join(base, "cases", str(next(counter)))
        os.makedirs(d)
        return d

    lm = _recipe(
        "llama3_debug.toml", base, training={"seq_len": 32}, checkpoint={"enable": False}, model={"n_layers": 1}
    )
    flux = _recipe("flux_debug.toml", base, training={"dataset": v["flux_data"]}, checkpoint={"enable": False})

    # --- recipes: trainer, engine, estimate, estimate_xla, benchmark ------------------------------
    recipe_users = {
        "train": (lambda r: ["-m", "trainer.train", "--config", r], lm, LM_KEYS),
        "train_flow": (lambda r: ["-m", "trainer.train", "--config", r], flux, FLOW_KEYS),
        "engine": (lambda r: ["-c", ENGINE, r], lm, LM_KEYS[1:2]),
        "estimate": (lambda r: ["scripts/estimate.py", "--config", r, "--target", "v6e-8"], lm, LM_KEYS[:2]),
        "estimate_xla": (lambda r: ["scripts/estimate_xla.py", "--config", r, "--target", "v6e-8"], lm, LM_KEYS[:1]),
        "benchmark": (
            lambda r: [
                "scripts/benchmark.py",
                "--config",
                r,
                "--steps",
                "2",
                "--warmup",
                "1",
                "--out",
                os.path.join(os.path.dirname(r), "bench.csv"),
            ],
            lm,
            LM_KEYS[1:2],
        ),
    }
    for entry, (argv_of, recipe, keys) in recipe_users.items():
        for cls, label, write, names in recipe_cases(recipe, keys, file_damage=entry != "train_flow"):
            work = work_dir()
            path = write(work)
            out[entry].append(
                ci.Case(
                    entry,
                    cls,
                    label,
                    argv_of(path),
                    names,
                    watch=[os.path.join(work, "dump"), os.path.join(work, "bench.csv")],
                )
            )

    # --- files a recipe names: tokenizer.json, HF config.json, FLUX data set ---------------------
    def recipe_naming(entry, recipe, set_path, src, dst_name, damages):
        for cls, label, apply, names in damages:
            work = work_dir()
            dst = _copy(src, os.path.join(work, dst_name))
            apply(dst)
            r = _in(work, recipe)
            set_path(r, dst)
            rpath = os.path.join(work, "recipe.toml")
            ci.write_toml(rpath, r)
            out[entry].append(
                ci.Case(
                    entry,
                    cls,
                    label,
                    ["-m", "trainer.train", "--config", rpath],
                    names,
                    watch=[os.path.join(work, "dump")],
                )
            )

    def set_tok(r, p):
        r["model"]["tokenizer"] = p

    recipe_naming(
        "train_tokenizer",
        lm,
        set_tok,
        v["tokenizer"],
        "tokenizer.json",
        _json_cases(v["tokenizer"], _tokenizer_keys(v)),
    )

    hf = _in(base, lm)
    hf["model"] = {"name": "hf", "flavor": "config"}

    def set_hf(r, p):
        r["model"]["hf_config"] = p

    recipe_naming(
        "train_hf",
        hf,
        set_hf,
        os.path.join(v["hf"], "config.json"),
        "config.json",
        _json_cases(os.path.join(v["hf"], "config.json"), HF_KEYS),
    )

    def set_data(r, p):
        r["training"]["dataset"] = os.path.dirname(p)

    meta = os.path.join(v["flux_data"], "meta.json")
    meta_keys = [
        ("shapes", "latent"),
        ("splits",),
        ("splits", "train", "rows"),
        ("params",),
        (("shapes", "t5"), [("wrong_type", "str", "16x64"), ("out_of_range", "neg", [-16, 64])]),
    ]
    for cls, label, apply, names in _json_cases(meta, meta_keys):
        work = work_dir()
        data = _copy(v["flux_data"], os.path.join(work, "data"))
        apply(os.path.join(data, "meta.json"))
        r = _in(work, flux)
        r["training"]["dataset"] = data
        rpath = os.path.join(work, "recipe.toml")
        ci.write_toml(rpath, r)
        out["train_flux_data"].append(
            ci.Case(
                "train_flux_data",
                cls,
                label,
                ["-m", "trainer.train", "--config", rpath],
                names + ["meta.json"],
                watch=[os.path.join(work, "dump")],
            )
        )
    shard = sorted(f for f in os.listdir(v["flux_data"]) if f.startswith("train-"))[0]
    for cls, label, apply in ci.damage_file(os.path.join(v["flux_data"], shard), fmt="parquet"):
        work = work_dir()
        data = _copy(v["flux_data"], os.path.join(work, "data"))
        _rebind_parquet(apply)(os.path.join(data, shard))
        r = _in(work, flux)
        r["training"]["dataset"] = data
        rpath = os.path.join(work, "recipe.toml")
        ci.write_toml(rpath, r)
        out["train_flux_data"].append(
            ci.Case(
                "train_flux_data",
                cls,
                label,
                ["-m", "trainer.train", "--config", rpath],
                [shard],
                watch=[os.path.join(work, "dump")],
            )
        )

    # --- convert: from-hf (config.json, safetensors, destination), to-hf (DCP, destination) --------
    for cls, label, apply, names in _json_cases(os.path.join(v["hf"], "config.json"), HF_KEYS[:3]):
        work = work_dir()
        hf_dir = _copy(v["hf"], os.path.join(work, "hf"))
        apply(os.path.join(hf_dir, "config.json"))
        out["convert_from_hf"].append(
            ci.Case(
                "convert_from_hf",
                cls,
                label,
                ["scripts/convert.py", "from-hf", hf_dir, os.path.join(work, "out")],
                names,
                watch=[os.path.join(work, "out")],
            )
        )
    for cls, label, apply in ci.damage_file(os.path.join(v["hf"], "model.safetensors"), fmt="safetensors"):
        work = work_dir()
        hf_dir = _copy(v["hf"], os.path.join(work, "hf"))
        _rebind_as(apply, "safetensors")(os.path.join(hf_dir, "model.safetensors"))
        out["convert_from_hf"].append(
            ci.Case(
                "convert_from_hf",
                cls,
                label,
                ["scripts/convert.py", "from-hf", hf_dir, os.path.join(work, "out")],
                ["model.safetensors", "safetensors"],
                watch=[os.path.join(work, "out")],
            )
        )
    work = work_dir()
    occupied = os.path.join(work, "out")
    os.makedirs(occupied)
    with open(os.path.join(occupied, "keep.txt"), "w") as f:
        f.write("earlier work\n")
    out["convert_from_hf"].append(
        ci.Case(
            "convert_from_hf",
            "occupied",
            "out",
            ["scripts/convert.py", "from-hf", v["hf"], occupied],
            [occupied],
            watch=[occupied],
        )
    )
    to_hf = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.n_layers=1"]
    for cls, label, apply in ci.damage_file(os.path.join(v["dcp"], ".metadata"), fmt="safetensors"):
        if cls == "malformed":
            continue  # .metadata is a pickle; truncated covers a damaged one
        work = work_dir()
        ckpt = _copy(v["dcp"], os.path.join(work, "step-1"))
        _rebind_as(apply, "safetensors")(os.path.join(ckpt, ".metadata"))
        out["convert_to_hf"].append(
            ci.Case(
                "convert_to_hf",
                cls,
                label,
                ["scripts/convert.py", "to-hf", "--checkpoint", ckpt, *to_hf, os.path.join(work, "out")],
                [ckpt, ".metadata"],
                watch=[os.path.join(work, "out")],
            )
        )
    for cls, label, flag, bad in cli_cases(
        {
            "--model.n_layers": (1, ("wrong_type", "out_of_range")),
            "--model.dim": (64, ("wrong_type", "non_finite", "out_of_range")),
        }
    ):
        work = work_dir()
        argv = [
            "scripts/convert.py",
            "to-hf",
            "--checkpoint",
            v["dcp"],
            "--model.name",
            "llama3",
            "--model.flavor",
            "debugmodel",
            f"{flag}={bad}",
            os.path.join(work, "out"),
        ]
        out["convert_to_hf"].append(
            ci.Case("convert_to_hf", cls, label, argv, [flag.split(".")[-1]], watch=[os.path.join(work, "out")])
        )
    out["convert_to_hf"].append(
        ci.Case(
            "convert_to_hf",
            "occupied",
            "out",
            ["scripts/convert.py", "to-hf", "--checkpoint", v["dcp"], *to_hf, occupied],
            [occupied],
            watch=[occupied],
        )
    )

    # --- FLUX run folder: sample.py, eval_flux.py ------------------------------------------------
    with open(os.path.join(v["flux_run"], "config.toml"), "rb") as f:
        run_cfg = tomllib.load(f)
    for entry, script, extra in (
        ("sample", "scripts/sample.py", ["--untrained", "--prompt", "a red circle"]),
        ("eval_flux", "scripts/eval_flux.py", []),
    ):

        def run_argv(run, work, more=()):
            dest = (
                ["--out", os.path.join(work, "s.png")]
                if entry == "sample"
                else ["--csv", os.path.join(work, "e.csv"), "--grid", os.path.join(work, "e.png")]
            )
            return [script, "--run", run, *extra, *dest, *more]

        watch = lambda work: [os.path.join(work, n) for n in ("s.png", "s.txt", "e.csv", "e.png", "run")]
        for cls, label, apply in ci.damage_file(os.path.join(v["flux_run"], "config.toml"), fmt="toml"):
            work = work_dir()
            run = _copy(v["flux_run"], os.path.join(work, "run"))
            _rebind(apply)(os.path.join(run, "config.toml"))
            out[entry].append(ci.Case(entry, cls, label, run_argv(run, work), ["config.toml", run], watch=watch(work)))
        for cls, label, data in ci.damage_data(run_cfg, [("flow", "shift")]):
            work = work_dir()
            run = _copy(v["flux_run"], os.path.join(work, "run"))
            ci.write_toml(os.path.join(run, "config.toml"), data)
            key = label.split("=")[0]
            out[entry].append(ci.Case(entry, cls, label, run_argv(run, work), [key], watch=watch(work)))
        flags = {"--cfg-scale": 4.0, "--steps": 2}
        flags.update({"--guidance": 1.0, "--scale": 2} if entry == "sample" else {"--samples-per-prompt": 2})
        for cls, label, flag, bad in cli_cases(flags):
            work = work_dir()
            out[entry].append(
                ci.Case(entry, cls, label, run_argv(v["flux_run"], work, [flag, bad]), [flag], watch=watch(work))
            )
        work = work_dir()
        out[entry].append(
            ci.Case(
                entry,
                "missing",
                "run",
                run_argv(os.path.join(work, "nope"), work),
                [os.path.join(work, "nope")],
                watch=watch(work),
            )
        )
    for cls, label, apply in ci.damage_file(v["prompts"], fmt="text"):
        work = work_dir()
        prompts = _copy(v["prompts"], os.path.join(work, "prompts.txt"))
        _rebind(apply)(prompts)
        out["sample"].append(
            ci.Case(
                "sample",
                cls,
                label,
                [
                    "scripts/sample.py",
                    "--run",
                    v["flux_run"],
                    "--untrained",
                    "--prompts-file",
                    prompts,
                    "--out",
                    os.path.join(work, "s.png"),
                ],
                ["prompts.txt", "--prompts-file"],
                watch=[os.path.join(work, "s.png")],
            )
        )

    # --- build_flux_data.py ------------------------------------------------------------------------
    for cls, label, flag, bad in cli_cases(
        {"--image-size": 32, "--num-train": 32, "--text-length": 16, "--shard-rows": 16, "--encoder-dtype": "float32"}
    ):
        work = work_dir()
        out["build_flux_data"].append(
            ci.Case(
                "build_flux_data",
                cls,
                label,
                ["scripts/data/build_flux_data.py", "--out", os.path.join(work, "out"), *SMALL_BUILD, flag, bad],
                [flag],
                watch=[os.path.join(work, "out")],
            )
        )
    for flags in (("--t5", "--clip"), ("--vae",)):
        work = work_dir()
        missing = [os.path.join(work, f"weights{i}") for i in range(len(flags))]
        out["build_flux_data"].append(
            ci.Case(
                "build_flux_data",
                "missing",
                flags[0],
                [
                    "scripts/data/build_flux_data.py",
                    "--out",
                    os.path.join(work, "out"),
                    *[x for pair in zip(flags, missing) for x in pair],
                ],
                missing[:1],
                watch=[os.path.join(work, "out")],
            )
        )
    work = work_dir()
    out["build_flux_data"].append(
        ci.Case(
            "build_flux_data",
            "inconsistent",
            "--t5-without-clip",
            ["scripts/data/build_flux_data.py", "--out", os.path.join(work, "out"), "--t5", v["base"]],
            ["t5_path", "--t5"],
            watch=[os.path.join(work, "out")],
        )
    )
    out["build_flux_data"].append(
        ci.Case(
            "build_flux_data",
            "occupied",
            "out",
            ["scripts/data/build_flux_data.py", "--out", occupied],
            [occupied],
            watch=[occupied],
        )
    )

    # --- command-line values of the planner scripts, the benchmark and the launcher ----------------
    lm_path = os.path.join(base, "lm.toml")
    ci.write_toml(lm_path, lm)
    keys = {
        "--seq-len": "training.seq_len",
        "--local-batch": "training.local_batch_size",
        "--tp": "parallelism.tensor_parallel_degree",
    }  # the short flags set these recipe keys
    for cls, label, flag, bad in cli_cases(
        {"--mfu": 0.4, "--headroom": 0.1, "--seq-len": 64, "--local-batch": 1, "--tp": 1, "--target": "v6e-8"}
    ):
        out["estimate"].append(
            ci.Case(
                "estimate",
                cls,
                label,
                ["scripts/estimate.py", "--config", lm_path, "--target", "v6e-8", flag, bad],
                [flag, keys.get(flag, flag)],
            )
        )
    for cls, label, flag, bad in cli_cases({"--target": "v6e-8"}):
        out["estimate_xla"].append(
            ci.Case("estimate_xla", cls, label, ["scripts/estimate_xla.py", "--config", lm_path, flag, bad], [flag])
        )
    for cls, label, flag, bad in cli_cases({"--steps": 2, "--warmup": 1, "--nproc": "1"}):
        work = work_dir()
        bench = os.path.join(work, "bench.csv")
        out["benchmark"].append(
            ci.Case(
                "benchmark",
                cls,
                label,
                ["scripts/benchmark.py", "--config", lm_path, "--out", bench, flag, bad],
                [flag],
                watch=[bench, os.path.join(base, "dump")],
            )
        )
    for cls, label, flag, bad in cli_cases(
        {
            "--nnodes": 1,
            "--node-rank": (0, ("wrong_type", "out_of_range")),
            "--master-port": 29501,
            "--nproc-per-node": 1,
        }
    ):
        words = {
            "--nnodes": "nodes",
            "--node-rank": "node rank",
            "--master-port": "port",
            "--nproc-per-node": "processes",
        }  # how the launcher's message names them
        manual = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--nproc-per-node", "1"]
        out["launch"].append(
            ci.Case(
                "launch",
                cls,
                label,
                [
                    "-m",
                    "trainer.launch",
                    "--platform",
                    "manual",
                    "--device",
                    "cpu",
                    "--dry-run",
                    *manual,
                    flag,
                    bad,
                    "--",
                    "--config",
                    lm_path,
                ],
                [flag, words[flag]],
            )
        )
    # the launcher's environment (Slurm's variables, the rendezvous port) and a TPU launch without torch-tpu
    slurm = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node1", "MASTER_PORT": "29501"}
    env_keys = [
        ("SLURM_NNODES",),
        ("SLURM_NODEID",),
        (("MASTER_PORT",), [("wrong_type", "str", "many"), ("out_of_range", "65536", 65536)]),
    ]
    for cls, label, env in ci.damage_data({k: int(v) if v.isdigit() else v for k, v in slurm.items()}, env_keys):
        key = label.split("=")[0]
        out["launch"].append(
            ci.Case(
                "launch",
                cls,
                label,
                [
                    "-m",
                    "trainer.launch",
                    "--platform",
                    "slurm",
                    "--device",
                    "cpu",
                    "--nproc-per-node",
                    "1",
                    "--dry-run",
                    "--",
                    "--config",
                    lm_path,
                ],
                [key],
                env={k: str(val) for k, val in env.items()},
            )
        )
    import importlib.util

    if importlib.util.find_spec("torch_tpu") is None:
        out["launch"].append(
            ci.Case(
                "launch",
                "inconsistent",
                "device-tpu-without-torch-tpu",
                [
                    "-m",
                    "trainer.launch",
                    "--platform",
                    "manual",
                    "--device",
                    "tpu",
                    *manual,
                    "--dry-run",
                    "--",
                    "--config",
                    lm_path,
                ],
                ["torch-tpu"],
            )
        )
    return out


def _rebind_as(apply, fmt):
    """`_rebind` for a file read as `fmt` whatever its name (None: from the extension)."""
    name = apply.__name__

    def run(path):
        kind = fmt or ("toml" if path.endswith(".toml") else "json" if path.endswith(".json") else "text")
        for _, _, fn in ci.damage_file(path, fmt=kind):
            if fn.__name__ == name:
                fn()
                return
        raise AssertionError(name)

    return run


def _rebind_parquet(apply):
    return _rebind_as(apply, "parquet")


SMALL_BUILD = ["--num-train", "32", "--num-heldout", "12", "--shard-rows", "16", "--vae-steps", "1"]
"""A build that would take seconds, should a bad value be let through."""

# --------------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def table(valid, tmp_path_factory):
    """entry point -> [(case, result, before, after)] after running every case once."""
    only = os.environ.get("CONTRACT_ONLY")  # comma-separated entry points, while working on one
    cases = [c for e, cs in rows(valid).items() for c in cs if not only or e in only.split(",")]
    before = [ci.snapshot(c.watch) for c in cases]
    work = str(tmp_path_factory.mktemp("runner"))
    todo = os.path.join(work, "cases.json")
    with open(todo, "w") as f:
        json.dump([{"argv": c.argv, "env": c.env} for c in cases], f)
    done = os.path.join(work, "results.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run(
        [PY, os.path.join(ROOT, "tests", "support", "contract_inputs.py"), todo, done, work],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=900,
    )
    with open(done) as f:
        results = json.load(f)
    out = collections.defaultdict(list)
    for c, r, b in zip(cases, results, before):
        out[c.entry].append((c, r, b, ci.snapshot(c.watch)))
    return out


KNOWN: dict[str, str] = {}
"""Case-id prefixes of failures in files this test's part does not own, reported to their owner;
the test requires them to still fail, so a fix shows up here and its entry is removed."""


def _violations(case: ci.Case, result: dict, before, after) -> list[str]:
    bad = []
    lines = result["stderr"].strip().splitlines()
    if result["rc"] != 2:
        bad.append(f"exit {result['rc']}, expected 2")
    if "Traceback" in result["stderr"]:
        bad.append("traceback")
    if len(lines) != 1:
        bad.append(f"{len(lines)} stderr lines, expected 1")
    elif not lines[0].startswith("error:"):
        bad.append("stderr line does not start with 'error:'")
    elif not any(n in lines[0] for n in case.names):
        bad.append(f"error line names none of {case.names}")
    if before != after:  # a run folder bad input created for its lock counts too (docs/training.md)
        bad.append("something was written")
    return bad


def test_contract_table(table):
    """Every case of every entry point keeps the contract; prints the table of counts."""
    failures, counts, known = [], collections.defaultdict(collections.Counter), []
    for entry, runs in table.items():
        for case, result, before, after in runs:
            counts[entry][case.cls] += 1
            bad = _violations(case, result, before, after)
            owner = next((why for prefix, why in KNOWN.items() if case.id.startswith(prefix)), None)
            if owner is not None:
                known.append(case.id)
                if not bad:
                    failures.append(f"{case.id}: now keeps the contract; remove its KNOWN entry ({owner})")
                continue
            if bad:
                failures.append(
                    f"{case.id}: {'; '.join(bad)}\n    argv: {case.argv[-4:]}\n    stderr: "
                    f"{result['stderr'].strip()[-600:]}"
                )
    print("\n" + format_counts(counts))
    print(f"known failures elsewhere: {len(known)} ({', '.join(sorted(set(KNOWN)))})")
    assert not failures, f"{len(failures)} cases break the contract:\n" + "\n".join(failures)


def format_counts(counts) -> str:
    """A Markdown table: entry point x input class -> number of cases."""
    classes = [c for c in ci.CLASSES if any(counts[e][c] for e in counts)]
    lines = ["| entry point | " + " | ".join(classes) + " | cases |", "|---" * (len(classes) + 2) + "|"]
    for entry in counts:
        cells = [str(counts[entry][c] or "") for c in classes]
        lines.append(f"| {entry} | " + " | ".join(cells) + f" | {sum(counts[entry].values())} |")
    total = collections.Counter()
    for entry in counts:
        total.update(counts[entry])
    lines.append("| all | " + " | ".join(str(total[c]) for c in classes) + f" | {sum(total.values())} |")
    return "\n".join(lines)


def test_runner_matches_a_real_process(table):
    """The forked runner gives what a real `python ...` process gives: the same exit status and
    stderr for one case of each of three entry points (a module, a script, a script reading a run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    entries = [e for e in ("train", "convert_from_hf", "sample") if table.get(e)]  # all but with CONTRACT_ONLY
    for entry in entries:
        case, result, _, _ = table[entry][0]
        proc = subprocess.run(
            [PY, *case.argv], cwd=ROOT, env={**env, **case.env}, capture_output=True, text=True, timeout=300
        )
        assert (proc.returncode, proc.stderr) == (result["rc"], result["stderr"]), case.id
