"""Loading a recipe: TOML -> the schema's dataclasses (trainer/config/schema.py) -> CLI
overrides -> validation of each value.

Precedence is CLI > TOML > defaults. `[model]` may also set any field of the chosen flavor's
args dataclass (e.g. `n_layers = 4`); those land in `ModelConfig.overrides`. Every user mistake
raises `ConfigError` naming the key or file and what is allowed. Combinations of valid values
(mode x parallelism x model x device x caller) are refused by the rule table
(trainer/step/plan.py `RULES`), once the device and the mesh are known.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from models.errors import ConfigError, check_choice
from trainer.config.schema import SECTIONS, Config, ModelConfig
from trainer.runtime.tpu_env import check_flags

# ----------------------------------------------------------------------------- parsing


def _did_you_mean(name: str, options: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_value(raw: str) -> Any:
    """A command-line value: a TOML literal when it parses as one (1, 0.5, true, [0.9, 0.95]),
    else the string itself. The trainer and every script parse `--section.key=value` with this."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if "," in raw and not raw.startswith("["):
            try:
                return tomllib.loads(f"v = [{raw}]")["v"]
            except tomllib.TOMLDecodeError:
                pass
        return raw


_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list such as [0.9, 0.95]",
    dict: "a table",
}


_LIST_EXAMPLES = {str: 'a list such as ["output", "layers.0"]', int: "a list such as [0, 1, 3, 2]"}


def _type_name(typ: Any) -> str:
    origin = typing.get_origin(typ) or typ
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(typ))
    if origin is list and typing.get_args(typ):  # the example in the element type
        return _LIST_EXAMPLES.get(typing.get_args(typ)[0], _TYPE_NAMES[list])
    return _TYPE_NAMES.get(origin, getattr(typ, "__name__", str(typ)))


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Check/convert one value to the declared type; ConfigError names the key.

    The one type check of the project: recipe keys, `[model]` overrides of the flavor's args
    and the scripts' `--model.FIELD=VALUE` options all go through it. An int is accepted for a
    float, "true"/"false" for a bool; an optional field (`int | None`) also takes the string
    "none" (how config.toml writes None) and otherwise any value one of its types accepts; a list
    of strings takes a string as its comma-separated names.
    """
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(typ)
        if type(None) in options and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        # str last: it accepts numbers, so `int | str` keeps 3 an int.
        for option in sorted((a for a in options if a is not type(None)), key=lambda a: a is str):
            try:
                return coerce(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}; allowed: {_type_name(typ)}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML and the command line both spell nan and inf
                raise ConfigError(f"{key}: {value!r} is not a finite number; allowed: a finite number")
            return float(value)
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif typ is list or origin is list:
        if isinstance(value, list):
            return value
        if typing.get_args(typ) == (str,) and isinstance(value, str):  # `--quantize.filter_fqns=output,gate`
            return [v.strip() for v in value.split(",") if v.strip()]
    elif typ is dict or origin is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}; allowed: {_type_name(typ)}")


def _check_metadata(key: str, value: Any, meta: typing.Mapping) -> None:
    if "choices" in meta:
        check_choice(key, value, meta["choices"])
    if meta.get("ge") is not None and value < meta["ge"]:
        raise ConfigError(f"{key}: {value!r} is out of range; must be >= {meta['ge']}; allowed: >= {meta['ge']}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise ConfigError(f"{key}: {value!r} is out of range; must be > {meta['gt']}; allowed: > {meta['gt']}")
    if meta.get("le") is not None and value > meta["le"]:
        raise ConfigError(f"{key}: {value!r} is out of range; must be <= {meta['le']}; allowed: <= {meta['le']}")


def _set(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section [{section}] in {source}{_did_you_mean(section, SECTIONS)} "
            f"(allowed: {', '.join(SECTIONS)})"
        )
    obj = getattr(cfg, section)
    types = _field_types(type(obj))
    if section == "model" and key not in types:
        # Flavor-args overrides are checked once the model family is known (resolve_model_args).
        obj.overrides[key] = value
        return
    if key not in types or (section == "model" and key == "overrides"):
        raise ConfigError(
            f"unknown key {section}.{key} in {source}{_did_you_mean(key, types, section + '.')}; "
            f"allowed: {', '.join(k for k in types if not (section == 'model' and k == 'overrides'))}"
        )
    setattr(obj, key, coerce(f"{section}.{key}", value, types[key]))


def load_toml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"recipe {path}: no such file; allowed: a TOML file that exists")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {path}: invalid TOML: {e}; allowed: a valid TOML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"recipe {path}: cannot read: {e}; allowed: a readable UTF-8 TOML file") from None


def split_cli(argv: list[str]) -> tuple[str | None, bool, list[tuple[str, str]]]:
    """Returns (recipe path, print_config, [(dotted key, raw value)]) from argv."""
    recipe, print_config, overrides = None, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--print-config":
            print_config = True
        elif arg in ("--config", "--job.config_file") or arg.startswith(("--config=", "--job.config_file=")):
            if "=" in arg:
                recipe = arg.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise ConfigError("--config: expected a recipe path after it; allowed: --config RECIPE.toml")
                i += 1
                recipe = argv[i]
        elif arg.startswith("--") and "." in arg:
            body = arg[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            else:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{arg}: expected a value; allowed: --{body}=VALUE or --{body} VALUE")
                i += 1
                key, raw = body, argv[i]
            overrides.append((key.replace("-", "_"), raw))
        else:
            raise ConfigError(
                f"unrecognized argument {arg!r}; allowed: --config RECIPE.toml, --print-config or --section.key=value"
            )
        i += 1
    return recipe, print_config, overrides


def parse_overrides(overrides: typing.Sequence[str | tuple[str, str]]) -> list[tuple[str, str]]:
    """`["training.seq_len=64", "--model.n_layers=2", ("optimizer.lr", "1e-4")]` -> [(key, raw)]."""
    out = []
    for item in overrides:
        if isinstance(item, tuple):
            out.append((item[0], str(item[1])))
            continue
        body = item[2:] if item.startswith("--") else item
        key, sep, raw = body.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r}: expected section.key=value; allowed: section.key=value")
        out.append((key.replace("-", "_"), raw))
    return out


def build_config(recipe: str | None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults <- TOML recipe <- CLI overrides, then validation."""
    cfg = Config()
    if recipe is not None:
        data = load_toml(recipe)
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{recipe}: top-level key {section!r} must be a [section] table; allowed: {', '.join(SECTIONS)}"
                )
            for key, value in table.items():
                _set(cfg, section, key, value, recipe)
    for dotted, raw in overrides:
        section, _, key = dotted.partition(".")
        if not key or "." in key:
            raise ConfigError(f"--{dotted}: expected --section.key=value; allowed: --section.key=value")
        _set(cfg, section, key, parse_value(raw), f"--{dotted}")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            _check_metadata(f"{section}.{f.name}", getattr(obj, f.name), f.metadata)
    betas = cfg.optimizer.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optimizer.betas: expected two numbers in [0, 1), got {betas!r}; allowed: e.g. [0.9, 0.95]")
    if not cfg.optimizer.muon_momentum < 1:
        raise ConfigError(f"optimizer.muon_momentum: {cfg.optimizer.muon_momentum!r}; allowed: a number in [0, 1)")
    exclude = cfg.optimizer.muon_exclude
    if not isinstance(exclude, list) or not all(isinstance(x, str) and x and "." not in x for x in exclude):
        raise ConfigError(
            f"optimizer.muon_exclude: {exclude!r}; allowed: a list of module-path components "
            '(names without dots), e.g. ["tok_embeddings", "output", "gate"]'
        )
    check_flags("device.libtpu_init_args", cfg.device.libtpu_init_args)
    check_flags("device.xla_flags", cfg.device.xla_flags)
    p = cfg.parallelism
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree: must be -1 (fill) or >= 1; allowed: -1 or a positive integer"
        )
    from parallelisms.device_order import check_spec

    check_spec(p.device_order)  # its fit to the world is checked at start-up (resolve_rank_order)
    _validate_hf_config(cfg)
    _validate_local_tier(cfg.checkpoint)
    # Combinations (mode x parallelism x model x device x caller, `flow.shift` x
    # `flow.resolution_shift`, TP x an hf model's plan, ...) are refused by one table,
    # trainer/step/plan.py RULES, once the device and the mesh are known (trainer.job.plan_job).


def _validate_local_tier(ck) -> None:
    """`checkpoint.local_folder`: a path on each host's own disk, so absolute (it does not follow
    job.dump_folder, which is shared) and never gs:// (the persistent tier is `folder`)."""
    folder = ck.local_folder
    if not folder:
        return
    if "://" in folder or not os.path.isabs(folder):
        raise ConfigError(
            f"checkpoint.local_folder: {folder!r}; allowed: an absolute path on each host's local disk "
            "(e.g. /mnt/local-ssd/ckpt; gs:// belongs in checkpoint.folder), or empty for no local tier"
        )


def _validate_hf_config(cfg: Config) -> None:
    """`model.hf_config` goes with `model.name = "hf"` (both ways): it decides which family and
    args there are, so it is checked here, before a step request can be made. (TP with an hf
    model whose plan does not translate is a rule, trainer/step/plan.py.)"""
    m = cfg.model
    if m.hf_config and m.name != "hf":
        raise ConfigError(
            f'model.hf_config: only used with model.name = "hf" (got {m.name!r}); allowed: empty for this model'
        )
    if m.name != "hf":
        return
    if not m.hf_config:
        raise ConfigError(
            'model.hf_config: required with model.name = "hf"; allowed: a local directory '
            "holding config.json, or a config.json file"
        )


def model_args(name: str, flavor: str, overrides: typing.Mapping[str, Any] = {}):
    """(family, args): flavor `flavor` of model family `name` with `overrides` (field -> value)
    type-checked by `coerce` and applied; the args' own checks become ConfigErrors naming the
    field. Used by the trainer (`resolve_model_args`) and by the scripts (scripts/convert.py)."""
    from models import get_model_family

    try:
        family = get_model_family(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e.args[0]) if e.args else f"model.name: {name!r}") from None
    if flavor not in family.flavors:
        raise ConfigError(
            f"model.flavor: {flavor!r} is not a {name} flavor{_did_you_mean(flavor, family.flavors)} "
            f"(allowed: {', '.join(family.flavors)})"
        )
    args = family.flavors[flavor]
    types_ = _field_types(type(args))
    changes = {}
    for key, value in overrides.items():
        if key not in types_:
            allowed = ["name", "flavor", "tokenizer", *types_]
            raise ConfigError(
                f"unknown key model.{key}{_did_you_mean(key, allowed, 'model.')}; allowed: {', '.join(allowed)}"
            )
        changes[key] = coerce(f"model.{key}", value, types_[key])
    try:
        args = dataclasses.replace(args, **changes)
    except ValueError as e:  # the args' own checks name the field: "n_layers: must be ..."
        raise ConfigError(f"model.{e}") from None
    return family, args


def resolve_model_args(cfg: ModelConfig, *, seq_len: int):
    """The flavor's args with [model] overrides applied (typed, validated)."""
    overrides = {**cfg.overrides, "hf_config": cfg.hf_config} if cfg.hf_config else cfg.overrides
    family, args = model_args(cfg.name, cfg.flavor, overrides)
    family = family.for_args(args)
    if hasattr(args, "max_seq_len") and "max_seq_len" not in cfg.overrides:
        # RoPE tables only need the training length (Llama 3.1 scaling reads
        # original_max_position_embeddings, not this), not the published 131072.
        args = dataclasses.replace(args, max_seq_len=seq_len)
    elif hasattr(args, "max_seq_len") and args.max_seq_len < seq_len:
        raise ConfigError(
            f"model.max_seq_len: {args.max_seq_len} is shorter than training.seq_len ({seq_len}); allowed: >= {seq_len}"
        )
    return family, args


# ----------------------------------------------------------------------------- output


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v)} to TOML")


def to_toml(cfg: Config) -> str:
    lines = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if section == "model" and f.name == "overrides":
                # TOML has no null: an override back to None is the flavor's default, so omit it.
                for k, v in value.items():
                    if v is not None:
                        lines.append(f"{k} = {_toml_value(v)}")
                continue
            lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def field_docs() -> dict[str, list[tuple[str, str, str]]]:
    """{section: [(key, default, doc)]}: parsed from the schema's field docstrings (for docs)."""
    import ast
    import inspect

    from trainer.config import schema

    tree = ast.parse(inspect.getsource(schema))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    out: dict[str, list[tuple[str, str, str]]] = {}
    for section, cls in SECTIONS.items():
        body = classes[cls.__name__].body
        defaults = cls()
        rows = []
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = ""
                if (
                    i + 1 < len(body)
                    and isinstance(body[i + 1], ast.Expr)
                    and isinstance(body[i + 1].value, ast.Constant)
                ):
                    doc = " ".join(str(body[i + 1].value.value).split())
                name = node.target.id
                rows.append((name, _toml_value(getattr(defaults, name)) if name != "overrides" else "", doc))
        out[section] = rows
    return out
