"""Model weights between our DCP checkpoints and Hugging Face safetensors: the library of
`scripts/convert.py` (its command line, docs/checkpointing.md).

- `convert_to_hf(checkpoint, family, args, out_dir, dtype=, hf_format=)`: a DCP checkpoint's model
  entries (`model.<param>`) -> `config.json` + `model*.safetensors` (diffusers:
  `diffusion_pytorch_model*.safetensors`), sharded above `MAX_SHARD_BYTES` with an index;
  `hf_format="fp8_blockwise"` writes DeepSeek-V3's FP8 hub format;
- `convert_from_hf(hf_dir, out_dir, dtype=)`: a Hugging Face folder -> a DCP checkpoint with keys
  `model.<param>`, FP8 hub weights dequantized.

Both stream (about one layer in memory): `to_hf` plans every file from the DCP metadata through the
adapter's `to_hf` on meta tensors, writes each safetensors header, then appends one layer at a time;
`from_hf` hands DCP a save planner whose `resolve_data` reads each parameter from the safetensors
only when DCP writes it. Both publish atomically under a lock on the destination
(trainer/runtime/atomic.py, runlock.py): bad input raises ConfigError, a failed write WriteFailed,
and nothing is left at the destination.
"""

import contextlib
import json
import math
import re
import typing
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from models import HF_MODEL_TYPES, ModelFamily, get_model_family
from models.errors import ConfigError
from trainer.checkpoint import (
    SAFETENSORS_DTYPE_NAMES,
    CorruptCheckpointError,
    SafetensorsSlices,
    check_entries,
    read_box_of,
    safetensors_files,
    short_error,
    verify_checkpoint,
    write_manifest,
)
from trainer.checkpoint.hf_fp8 import (
    HF_FORMATS,
    HUB_QUANTIZATION_CONFIG,
    quantization_of,
    quantize_hf_state_dict,
)
from trainer.config import coerce
from trainer.runtime.atomic import WriteFailed, atomic_dir, errno_text
from trainer.runtime.runlock import lock_destination

MODEL_PREFIX = "model."
MAX_SHARD_BYTES = 5 * 1024**3

# DCP warns on every call that it runs without a process group; that is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _resolve_checkpoint(path: Path) -> Path:
    """A DCP directory: `path` itself, or its `step-N` subfolder with the largest N."""
    if (path / ".metadata").is_file():
        return path
    steps = [(int(m.group(1)), p) for p in path.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
    steps = [(n, p) for n, p in steps if (p / ".metadata").is_file()]
    if not steps:
        raise ConfigError(
            f"--checkpoint {path}: not a DCP checkpoint (no .metadata) and no step-N checkpoints inside; "
            "allowed: a DCP checkpoint folder or a folder of step-N checkpoints"
        )
    return max(steps)[1]


def _meta_model_shapes(family: ModelFamily, args) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = family.model_cls(args)
    return {k: v.shape for k, v in model.state_dict().items()}


def _layer_groups(keys: list[str]) -> list[list[str]]:
    """Keys grouped as [non-block keys] + one group per block (`<stack>.<i>.`: `layers.3.`,
    FLUX's `double_blocks.0.` / `single_blocks.5.`), stacks in order of appearance."""
    top, blocks = [], {}
    stacks: list[str] = []
    for key in keys:
        m = re.match(r"([a-z_]+)\.(\d+)\.", key)
        if m is None:
            top.append(key)
        else:
            if m.group(1) not in stacks:
                stacks.append(m.group(1))
            blocks.setdefault((m.group(1), int(m.group(2))), []).append(key)
    return [top] + [blocks[k] for k in sorted(blocks, key=lambda k: (stacks.index(k[0]), k[1]))]


def _check_destination(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise ConfigError(
            f"{out_dir}: exists and is not an empty folder; allowed: a new or empty folder "
            "(a conversion never writes over or into earlier output)"
        )


@contextlib.contextmanager
def _destination(out_dir: Path, *, what: str):
    """A temporary folder beside `out_dir`, renamed to it when the conversion has written every file
    (trainer/runtime/atomic.py): a failed or killed conversion leaves nothing at `out_dir`. The
    destination is locked for the conversion's time (a second conversion into it is refused,
    naming the first) and must be new or an empty folder."""
    _check_destination(out_dir)
    with lock_destination(out_dir, key=str(out_dir), who="conversion"):
        _check_destination(out_dir)  # again, under the lock
        with atomic_dir(out_dir, what=what) as tmp:
            yield tmp


def convert_to_hf(
    checkpoint: Path,
    family: ModelFamily,
    args,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    hf_format: str = "default",
) -> list[Path]:
    """DCP checkpoint -> HF folder (config.json + safetensors), published atomically (`_destination`).
    `hf_format` "fp8_blockwise": the weights the family's `fp8_hub_weight` selects are written as
    float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block (trainer/checkpoint/hf_fp8.py),
    and config.json gets the fp8 `quantization_config`. Returns the safetensors files written."""
    if hf_format not in HF_FORMATS:
        raise ConfigError(f"--hf-format: {hf_format!r} unknown; allowed: {', '.join(HF_FORMATS)}")
    fp8_weight = getattr(family.hf_adapter, "fp8_hub_weight", None)
    if hf_format == "fp8_blockwise" and fp8_weight is None:
        raise ConfigError(
            f"--hf-format fp8_blockwise: {family.name} has no FP8 hub format; allowed: deepseek_v3 "
            "(DeepSeek-V3 / Kimi K2 checkpoints), or --hf-format default"
        )
    with _destination(out_dir, what="Hugging Face folder") as tmp:
        written = _convert_to_hf(
            checkpoint, family, args, tmp, dtype=dtype, fp8_weight=fp8_weight if hf_format == "fp8_blockwise" else None
        )
    return [out_dir / path.name for path in written]


def _convert_to_hf(
    checkpoint: Path,
    family: ModelFamily,
    args,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    fp8_weight=None,
) -> list[Path]:
    checkpoint = _resolve_checkpoint(checkpoint)
    stored, alias, keys = _stored_model_entries(checkpoint, family, args)

    def template(group: list[str], device: str) -> dict[str, torch.Tensor]:
        return {
            alias.get(k, k): torch.empty(stored[k].size, dtype=stored[k].properties.dtype, device=device) for k in group
        }

    def convert_group(group: list[str], device: str) -> dict[str, torch.Tensor]:
        tensors = template(group, device)
        if device != "meta":
            dcp.load({"model": tensors}, checkpoint_id=str(checkpoint))
        ours = {k: tensors[alias.get(k, k)] for k in group}
        hf = family.hf_adapter.to_hf(ours, args)
        if fp8_weight is not None:  # quantized from the stored values; --dtype casts the rest
            hf = quantize_hf_state_dict(hf, fp8_weight)
            return {
                k: v if dtype is None or v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv") else v.to(dtype)
                for k, v in hf.items()
            }
        return {hf_key: value if dtype is None else value.to(dtype) for hf_key, value in hf.items()}

    # Plan every file from the metadata: the adapter's to_hf on meta tensors gives the HF names,
    # shapes and dtypes of each group (one block, or the non-block entries) without any data.
    groups = _layer_groups(keys)
    planned = [{k: (tuple(v.shape), v.dtype) for k, v in convert_group(g, "meta").items()} for g in groups]
    shards = _pack_shards([sum(math.prod(shape) * dt.itemsize for shape, dt in p.values()) for p in planned])
    # transformers reads model*.safetensors, diffusers diffusion_pytorch_model*.safetensors.
    base = getattr(family.hf_adapter, "WEIGHTS_NAME", "model")
    written = _write_shards(out_dir, base, shards, planned, lambda gi: convert_group(groups[gi], "cpu"))

    config = family.hf_adapter.hf_config(args)
    saved_dtype = dtype or stored[keys[0]].properties.dtype
    config["torch_dtype"] = str(saved_dtype).removeprefix("torch.")
    if fp8_weight is not None:
        config["quantization_config"] = dict(HUB_QUANTIZATION_CONFIG)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


def _stored_model_entries(checkpoint: Path, family: ModelFamily, args) -> tuple[dict, dict[str, str], list[str]]:
    """(the stored model entries' metadata by FQN, the alias of a tied embedding saved under
    output.weight, the keys to convert), after checking the entries against the model of `args`."""
    try:
        verify_checkpoint(checkpoint)
    except CorruptCheckpointError as e:
        raise ConfigError(f"--checkpoint {checkpoint} is corrupt: {e}; allowed: an intact checkpoint") from None
    try:
        metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises any of a dozen types
        raise ConfigError(
            f"--checkpoint {checkpoint}: cannot read its .metadata ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); allowed: a DCP checkpoint folder"
        ) from None
    stored = {
        k[len(MODEL_PREFIX) :]: v for k, v in metadata.items() if k.startswith(MODEL_PREFIX) and hasattr(v, "size")
    }
    expected = _meta_model_shapes(family, args)
    tie_embeddings = getattr(args, "tie_embeddings", False)
    if tie_embeddings and "tok_embeddings.weight" not in stored and "output.weight" in stored:
        stored["tok_embeddings.weight"] = stored["output.weight"]  # a tied matrix saved under one name
        alias = {"tok_embeddings.weight": "output.weight"}
    else:
        alias = {}
    # Every entry in both directions: a checkpoint with more layers than the args must not
    # convert its first n_layers silently. A tied model's output.weight is the embedding.
    tied = {"output.weight"} if tie_embeddings else set()
    check_entries(
        expected={MODEL_PREFIX + k: tuple(v) for k, v in expected.items() if k not in tied},
        stored={MODEL_PREFIX + k: tuple(v.size) for k, v in stored.items() if k not in tied},
        key="--checkpoint",
        where=str(checkpoint),
        what=f"{family.name} with model.flavor/overrides",
        fix="pass the --model.flavor and --model.FIELD=VALUE overrides the checkpoint was trained with",
    )
    keys = [k for k in expected if k in stored and not (tie_embeddings and k == "output.weight")]

    return stored, alias, keys


def _pack_shards(group_bytes: list[int]) -> list[list[int]]:
    """The groups (by index, in order) of each safetensors file, a file closed before it would pass
    MAX_SHARD_BYTES."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(group_bytes):
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _write_shards(out_dir: Path, base: str, shards: list[list[int]], planned: list[dict], convert) -> list[Path]:
    """Write each shard's file (`convert(group_index)` gives a group's HF tensors) and, for more
    than one file, the index; returns the files written."""
    names = (
        [f"{base}.safetensors"]
        if len(shards) == 1
        else [f"{base}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total, written = {}, 0, []
    for name, shard in zip(names, shards):
        entries = {k: v for gi in shard for k, v in planned[gi].items()}
        _write_safetensors(out_dir / name, entries, (convert(gi) for gi in shard))
        written.append(out_dir / name)
        for hf_key, (shape, dt) in entries.items():
            weight_map[hf_key] = name
            total += math.prod(shape) * dt.itemsize
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / f"{base}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written


def _write_safetensors(path: Path, entries: dict[str, tuple[tuple[int, ...], torch.dtype]], chunks) -> None:
    """A safetensors file written as its data arrives: the header (8-byte little-endian length,
    JSON padded with spaces to 8 bytes, as the format specifies) from the planned `entries`, then
    the bytes of each tensor of each dict in `chunks`, in the order of `entries`."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, (shape, dt) in entries.items():
        nbytes = math.prod(shape) * dt.itemsize
        header[key] = {
            "dtype": SAFETENSORS_DTYPE_NAMES[dt],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    order = iter(entries)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for tensors in chunks:
            for key, value in tensors.items():
                expected_key = next(order)
                assert key == expected_key and (tuple(value.shape), value.dtype) == entries[key], (
                    f"{key}: converted differently from its plan {expected_key} {entries[expected_key]}"
                )
                f.write(value.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensors
    assert next(order, None) is None, f"{path}: fewer tensors written than planned"


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP save planner over a state dict of meta tensors: `resolve_data` makes each tensor only
    when the storage writer asks for it (FileSystemWriter asks one item at a time)."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def resolve_data(self, write_item):
        return self._make(write_item.index.fqn)


def convert_from_hf(hf_dir: Path, out_dir: Path, *, dtype: torch.dtype | None = None) -> tuple[str, object]:
    """HF folder -> DCP checkpoint with keys `model.<param>`, published atomically (`_destination`).
    Returns (family name, args)."""
    with _destination(out_dir, what="DCP checkpoint") as tmp:
        return _convert_from_hf(hf_dir, tmp, dtype=dtype, dest=out_dir)


def _read_hf_config(path: Path) -> dict:
    """config.json as a dict; ConfigError naming the file otherwise."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise ConfigError(f"{path}: cannot read as JSON ({reason}); allowed: a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path}: expected a JSON object, got {type(config).__name__}; allowed: a Hugging Face config.json"
        )
    return config


def _check_hf_args(args, path: Path) -> None:
    """The model args read from config.json: each field of its declared type (the trainer's
    `coerce`: finite numbers), no negative sizes; ConfigError naming the file and the field."""
    import dataclasses

    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in hints:
            coerce(f"{path}: {f.name}", value, hints[f.name])
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{path}: {f.name} = {value}; allowed: >= 0")


def _convert_from_hf(hf_dir: Path, out_dir: Path, *, dtype: torch.dtype | None, dest: Path) -> tuple[str, object]:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path}: not found; allowed: a Hugging Face model folder with config.json")
    config = _read_hf_config(config_path)
    # transformers configs name the architecture in model_type, diffusers in _class_name.
    model_type = config.get("model_type", config.get("_class_name"))
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"{hf_dir / 'config.json'}: model_type {model_type!r} unsupported; allowed: {list(HF_MODEL_TYPES)}"
        )
    family = get_model_family(HF_MODEL_TYPES[model_type])
    files = safetensors_files(hf_dir)
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(
            f"{hf_dir}: no *.safetensors files (PyTorch .bin checkpoints are not supported); allowed: a folder "
            "with *.safetensors"
        )
    try:
        reader = SafetensorsSlices(files, fp8_block=quantization_of(config, where=config_path), config=config_path)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hf_dir}: {e}; allowed: readable safetensors files") from e
    try:
        args = family.hf_adapter.args_from_hf_config(config)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        allowed = "" if "allowed:" in what else f"; allowed: a config.json of a {model_type!r} model"
        raise ConfigError(f"{config_path}: {what}{allowed}") from None
    _check_hf_args(args, config_path)
    try:
        layout = family.hf_adapter.hf_layout(reader.shapes(), args)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hf_dir}: {e}; allowed: weights that match config.json") from e
    expected = _meta_model_shapes(family, args)
    check_entries(
        expected={k: tuple(v) for k, v in expected.items()},
        stored={k: tuple(entry.shape) for k, entry in layout.items()},
        key=str(hf_dir),
        where="its safetensors",
        what="the model its config.json describes",
        fix="allowed: weights that match config.json (num_hidden_layers, hidden_size, ...)",
    )
    meta = {
        k: torch.empty(entry.shape, dtype=dtype or reader.dtype(entry.pieces[0].hf_key), device="meta")
        for k, entry in layout.items()
    }

    read_failed = []  # a failed read is bad input (exit 2); anything else failed writing

    def make(fqn: str) -> torch.Tensor:
        name = fqn[len(MODEL_PREFIX) :]
        entry = layout[name]
        try:
            value = read_box_of(entry, (0,) * len(entry.shape), entry.shape, reader)
        except BaseException:
            read_failed.append(name)
            raise
        finally:
            reader.release()  # unmap the file: its touched pages leave the resident set
        return value.to(meta[name].dtype, copy=True)  # a copy: `value` may be a view of the map

    # One file per tensor: FileSystemWriter keeps every tensor of a file alive until that file is
    # closed, so one file per rank would hold the whole model.
    writer = dcp.FileSystemWriter(str(out_dir), single_file_per_rank=False, thread_count=1)
    try:
        dcp.save({"model": meta}, storage_writer=writer, planner=_StreamingSavePlanner(make))
    except (Exception, CheckpointException) as e:  # DCP reports a failed read as CheckpointException
        if read_failed:
            raise ConfigError(
                f"{hf_dir}: cannot read its safetensors: {short_error(e)}; allowed: readable safetensors files"
            ) from e
        why = errno_text(e, out_dir.parent) or short_error(e)
        raise WriteFailed(f"writing DCP checkpoint {dest} failed: {why}; nothing was left at the destination") from e
    write_manifest(out_dir)
    return family.name, args
