"""Initial weights: a DCP checkpoint or Hugging Face safetensors (read slice by slice, so each
rank reads only its shards), and the HF config.json check against the model args."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models.errors import ConfigError
from trainer.checkpoint.hf_fp8 import FP8Blocks, dequantize_hf_state_dict, quantization_of
from trainer.checkpoint.hf_mxfp4 import MXFP4Experts
from trainer.checkpoint.manager import _shape, _stored_shapes, check_entries
from trainer.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint
from trainer.checkpoint.state import _DCP_ERRORS, _dist_on, _fmt, _rank, _say, logger, short_error

# ---------------------------------------------------------------------------------------------
# Initial weights.


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder (those its index names, if it has one) or file."""
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor in a safetensors file, from its header alone (the
    8-byte little-endian header length, then that many bytes of JSON; no tensor data is read)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 * 1024**2:
            raise ValueError(f"{file}: not a safetensors file (header length {size})")
        header = json.loads(f.read(size))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: {name} has dtype {info['dtype']}; allowed: {sorted(_SAFETENSORS_DTYPES)}")
        out[name] = (tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]])
    return out


class SafetensorsSlices:
    """Reads boxes of tensors from a set of safetensors files with `safe_open(...).get_slice`,
    opening a file only when a box in it is asked for, and counting what it reads.

    `release()` closes the open files: safe_open memory-maps a file, and the pages a read touched
    count in the process's resident memory until the map goes, so the loader and the converter
    release after each of our parameters (their peak is then one parameter's box, not a file).
    A tensor `read` returns may be a view of the map (no copy; it keeps the map alive): copy
    what must outlive the next `release()`.

    FP8 block-scaled folders (DeepSeek-V3 / Kimi K2 on the hub; hf_fp8.py): `fp8_block` is the
    block size of config.json's `quantization_config` (`hf_fp8.quantization_of`), None if it
    declares none. Every float8 weight is paired with its `weight_scale_inv` from the headers
    (ConfigError naming the file and tensor if one is missing or misshapen); `shapes()` then
    lists the weights without their scales, `dtype()` says float32 for them, and `read` returns
    a box of such a weight dequantized from its fp8 box and the scales of the blocks it touches.
    MXFP4 experts (gpt-oss on the hub; hf_mxfp4.py): each `X_blocks` / `X_scales` pair is listed
    as the dequantized `X` [..., in, out] (bfloat16, exact), read box by box likewise.
    """

    def __init__(self, files: list[Path], *, fp8_block: tuple[int, int] | None = None, config: Path | None = None):
        self.tensors: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            for name, (shape, dtype) in safetensors_header(file).items():
                if name in self.tensors:
                    raise ValueError(f"{name}: in both {self.tensors[name][0].name} and {file.name}")
                self.tensors[name] = (file, shape, dtype)
        where = config or (files[0].parent / "config.json" if files else "config.json")
        self.fp8 = FP8Blocks.pair(self.tensors, fp8_block, config=where)
        self.mxfp4 = MXFP4Experts.pair(self.tensors, config=where)
        self.bytes_read = 0
        self.files_read: set[Path] = set()
        self._open: dict[Path, Any] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        hidden = (self.fp8.scale_names if self.fp8 else set()) | (self.mxfp4.stored_names if self.mxfp4 else set())
        shapes = {name: shape for name, (_, shape, _) in self.tensors.items() if name not in hidden}
        return {**shapes, **(self.mxfp4.shapes if self.mxfp4 else {})}

    def dtype(self, name: str) -> torch.dtype:
        if self.fp8 and name in self.fp8.scale_of:
            return torch.float32  # dequantized
        if self.mxfp4 and name in self.mxfp4.packed:
            return torch.bfloat16  # dequantized (exact)
        return self.tensors[name][2]

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """HF tensor `name`'s box `slices` (one slice per dim, step 1; () for a whole 0-d tensor);
        a float8 weight's box dequantized to float32 (see the class docstring)."""
        if self.fp8 and name in self.fp8.scale_of:
            return self.fp8.read(name, slices, self.tensors[name][1], self._read)
        if self.mxfp4 and name in self.mxfp4.packed:
            return self.mxfp4.read(name, slices, self._read)
        return self._read(name, slices)

    def _read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        file = self.tensors[name][0]
        if file not in self._open:
            handle = safe_open(str(file), framework="pt")
            self._open[file] = (handle, handle.__enter__())
        f = self._open[file][1]
        value = f.get_slice(name)[slices] if slices else f.get_tensor(name)
        self.bytes_read += value.numel() * value.element_size()
        self.files_read.add(file)
        return value

    def release(self) -> None:
        for handle, _ in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def local_box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, shape) of the part of `value` this rank holds: all of a plain tensor, the
    local shard of a DTensor (Shard / _StridedShard / Replicate placements, any mesh)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return (0,) * value.ndim, tuple(value.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    assert tuple(shape) == tuple(value.to_local().shape), (
        f"local box {shape} != local shard {tuple(value.to_local().shape)} for placements {value.placements}"
    )
    return tuple(offset), tuple(shape)


def _load_hf_sliced(
    model: torch.nn.Module,
    files: list[Path],
    *,
    hf_layout: Any,
    args: Any,
    expected: dict[str, tuple | None],
    root: Path,
    fp8_block: tuple[int, int] | None,
    config: Path,
) -> SafetensorsSlices:
    """Each rank reads only the HF bytes of its own shard of each parameter (see load_initial)."""
    from safetensors import SafetensorError
    from torch.distributed.tensor import DTensor

    key = "checkpoint.initial_load_path"
    try:
        reader = SafetensorsSlices(files, fp8_block=fp8_block, config=config)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {root}: {short_error(e)}; allowed: readable checkpoint files") from e
    try:
        layout = hf_layout(reader.shapes(), args)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{key}: {root} does not match the model: {short_error(e)}; allowed: weights of the recipe's model (its architecture and sizes)"
        ) from e
    check_entries(
        expected=expected,
        stored={k: entry.shape for k, entry in layout.items()},
        key=key,
        where=str(root),
        what="the model",
    )
    model_sd = get_model_state_dict(model)
    try:
        with torch.no_grad():
            for name, target in model_sd.items():
                entry = layout[name]
                offset, shape = local_box(target)
                box = read_box_of(entry, offset, shape, reader)
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(box)
                reader.release()
    except (OSError, RuntimeError, SafetensorError) as e:  # a truncated or unreadable file
        raise ConfigError(f"{key}: cannot read {root}: {short_error(e)}; allowed: readable checkpoint files") from e
    finally:
        reader.release()
    # get_model_state_dict's tensors normally share storage with the parameters, and then the
    # copies above are the load; otherwise (a wrapper that copies) load them the usual way.
    own = {_data_ptr(t) for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
    if not all(_data_ptr(t) in own for t in model_sd.values() if isinstance(t, torch.Tensor)):
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
    return reader


def _data_ptr(value: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (value.to_local() if isinstance(value, DTensor) else value).data_ptr()


def read_box_of(entry: Any, offset: tuple[int, ...], shape: tuple[int, ...], reader: SafetensorsSlices) -> torch.Tensor:
    """Box [offset, offset + shape) of our parameter `entry` (an `HFEntry`) read through `reader`."""
    from models.common.hf_adapter import read_box

    return read_box(entry, offset, shape, reader.dtype(entry.pieces[0].hf_key), reader.read)


HF_CONFIG_MISMATCH = ("error", "override")
INITIAL_LOAD_FORMATS = ("dcp", "hf")


def load_initial(
    model: torch.nn.Module,
    *,
    path: str | os.PathLike,
    fmt: str,
    hf_adapter: Any = None,
    args: Any = None,
    hf_config_mismatch: str = "error",
) -> None:
    """Load model weights (only) to start training from: a DCP folder or HF safetensors.

    Call on every rank after the model is materialized (and parallelized: DTensor parameters
    receive their own shards).
    fmt "dcp": a DCP folder whose keys are either `model.<fqn>` (a checkpoint of this trainer or
        of scripts/convert) or bare `<fqn>`; other states in it are ignored. Its manifest.json
        (if any) is verified first.
    fmt "hf": a folder of *.safetensors (with model.safetensors.index.json if sharded) or one
        .safetensors file, with the model's config.json next to it; `hf_adapter` is the model
        family's hf_adapter module (or its `from_hf` function). With an adapter that has `hf_layout`,
        each rank reads every file's header and then, for each parameter, only the slices of
        the HF tensors that its own shard covers (`safe_open(...).get_slice`); files holding
        none of them are never opened. With only `from_hf(hf_state_dict, args)`, every rank
        reads the full weights into host memory.
        FP8 block-scaled weights (a config.json `quantization_config` of quant_method fp8, as
        DeepSeek-V3's and Kimi K2's hub checkpoints have) are dequantized with their
        `weight_scale_inv` into float32 and then cast to the parameters' dtype; a rank reads the
        fp8 bytes of its box and the scales of the blocks it touches (hf_fp8.py).
        The architecture in config.json (as `hf_adapter.args_from_hf_config` reads it) is
        compared with `args`: any difference (rope_theta, RoPE scaling, norm eps, layer
        count...) raises ConfigError when `hf_config_mismatch` is "error"; with "override" the
        run's `args` win and each difference is printed.
    Bad paths and weights whose names or shapes differ from the model's in either direction
    raise ConfigError naming checkpoint.initial_load_path; nothing is loaded then.
    """
    key = "checkpoint.initial_load_path"
    if fmt not in INITIAL_LOAD_FORMATS:
        raise ConfigError(f"checkpoint.initial_load_format: {fmt!r}; allowed: {', '.join(INITIAL_LOAD_FORMATS)}")
    if hf_config_mismatch not in HF_CONFIG_MISMATCH:
        raise ConfigError(
            f"checkpoint.hf_config_mismatch: {hf_config_mismatch!r}; allowed: {', '.join(HF_CONFIG_MISMATCH)}"
        )
    root = Path(path) if path else None
    if root is None or not root.exists():
        raise ConfigError(f"{key}: {str(path)!r} does not exist; allowed: a DCP checkpoint folder or HF safetensors")
    expected = {k: _shape(v) for k, v in get_model_state_dict(model).items()}
    if fmt == "dcp":
        _load_dcp(model, root, expected=expected, key=key)
    else:
        _load_hf(
            model,
            root,
            hf_adapter=hf_adapter,
            args=args,
            hf_config_mismatch=hf_config_mismatch,
            expected=expected,
            key=key,
        )


def _load_dcp(model: torch.nn.Module, root: Path, *, expected: dict, key: str) -> None:
    """fmt "dcp" of `load_initial`: verify the folder, check its model entries, load them."""
    if not (root / ".metadata").is_file():
        raise ConfigError(
            f"{key}: {root} is not a DCP checkpoint folder (no .metadata); "
            'allowed: a DCP folder, or for safetensors initial_load_format = "hf"'
        )
    try:
        verify_checkpoint(root)
    except CorruptCheckpointError as e:
        raise ConfigError(f"{key}: {root} is corrupt: {e}; allowed: an intact checkpoint") from None
    try:
        stored = _stored_shapes(root)
    except Exception as e:
        raise ConfigError(
            f"{key}: {root} is not a readable DCP checkpoint ({short_error(e)}); allowed: a DCP checkpoint folder"
        ) from e
    prefixed = any(k.startswith("model.") for k in stored)
    if prefixed:
        stored = {k[len("model.") :]: v for k, v in stored.items() if k.startswith("model.")}
    check_entries(expected=expected, stored=stored, key=key, where=str(root), what="the model")
    model_sd = get_model_state_dict(model)
    dest = {"model": model_sd} if prefixed else model_sd
    try:
        dcp.load(dest, checkpoint_id=str(root), no_dist=not _dist_on())
    except _DCP_ERRORS as e:
        raise ConfigError(
            f"{key}: cannot load {root}: {short_error(e)}; allowed: a DCP checkpoint of this model"
        ) from e
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))


def _load_hf(
    model: torch.nn.Module,
    root: Path,
    *,
    hf_adapter: Any,
    args: Any,
    hf_config_mismatch: str,
    expected: dict,
    key: str,
) -> None:
    """fmt "hf" of `load_initial`: check config.json against `args`, then read each rank's slices
    (an adapter with `hf_layout`) or every file in full (`from_hf` only)."""
    files = safetensors_files(root)
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(
            f"{key}: no safetensors weights at {root}; "
            "allowed: a folder with *.safetensors (and model.safetensors.index.json if sharded)"
        )
    from_hf = getattr(hf_adapter, "from_hf", hf_adapter)
    assert from_hf is not None, "initial_load_format hf without an hf_adapter: the step plan's RULES refuse it first"
    if hasattr(hf_adapter, "args_from_hf_config") and args is not None:
        check_hf_config(
            root if root.is_dir() else root.parent, hf_adapter=hf_adapter, args=args, mismatch=hf_config_mismatch
        )
    config = (root if root.is_dir() else root.parent) / "config.json"
    fp8_block = hf_fp8_block(config)
    hf_layout = getattr(hf_adapter, "hf_layout", None)
    if hf_layout is not None:
        reader = _load_hf_sliced(
            model,
            files,
            hf_layout=hf_layout,
            args=args,
            expected=expected,
            root=root,
            fp8_block=fp8_block,
            config=config,
        )
        logger.info(
            "checkpoint: rank %d read %.1f MB of tensor data from %d of %d safetensors files",
            _rank(),
            reader.bytes_read / 1e6,
            len(reader.files_read),
            len(files),
        )
        return
    _load_hf_full(
        model,
        files,
        from_hf=from_hf,
        args=args,
        expected=expected,
        root=root,
        fp8_block=fp8_block,
        config=config,
        key=key,
    )


def _load_hf_full(
    model: torch.nn.Module,
    files: list[Path],
    *,
    from_hf: Any,
    args: Any,
    expected: dict,
    root: Path,
    fp8_block: tuple[int, int] | None,
    config: Path,
    key: str,
) -> None:
    """An adapter with only `from_hf` (a state dict in, a state dict out): every rank reads all."""
    from safetensors.torch import load_file

    hf_state_dict: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            hf_state_dict.update(load_file(str(file)))
    except Exception as e:
        raise ConfigError(f"{key}: cannot read {root}: {short_error(e)}; allowed: readable checkpoint files") from e
    hf_state_dict = dequantize_hf_state_dict(hf_state_dict, fp8_block, files=str(root), config=config)
    try:
        state_dict = from_hf(hf_state_dict, args)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{key}: {root} does not match the model: {short_error(e)}; allowed: weights of the recipe's model (its architecture and sizes)"
        ) from e
    check_entries(
        expected=expected,
        stored={k: _shape(v) for k, v in state_dict.items()},
        key=key,
        where=str(root),
        what="the model",
    )
    try:
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    except RuntimeError as e:  # anything the checks above did not foresee
        raise ConfigError(
            f"{key}: {root} does not match the model: {short_error(e)}; allowed: weights of the recipe's model (its architecture and sizes)"
        ) from e


def hf_fp8_block(config: Path) -> tuple[int, int] | None:
    """The FP8 block size that `config` (an HF config.json) declares in its quantization_config,
    None without one or without the file (hf_fp8.quantization_of; ConfigError for another kind)."""
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"checkpoint.initial_load_path: cannot read {config}: {short_error(e)}; allowed: a readable JSON config.json"
        ) from None
    return quantization_of(data, where=config) if isinstance(data, dict) else None


# Keys of hf_config(args) that are not architecture: the RoPE table length (the trainer sets it to
# the training seq_len), bookkeeping, and values that follow from compared ones. DeepSeek-V3's
# MTP layers (`num_nextn_predict_layers`) are an optional extra: a run without MTP loads the main
# model of a checkpoint with them, and a run with MTP finds its MTP weights or names them missing.
_NOT_ARCHITECTURE = {
    "num_nextn_predict_layers",
    "max_position_embeddings",
    "max_window_layers",
    "architectures",
    "torch_dtype",
    "use_cache",
    "initializer_range",
    "transformers_version",
    "router_aux_loss_coef",
    "output_router_logits",
}


def hf_config_differences(hf_config: dict[str, Any], *, hf_adapter: Any, args: Any) -> list[tuple[str, Any, Any]]:
    """[(config.json key, its value, this run's value)] for every architectural difference.

    Both sides are put in the same canonical form first: `hf_adapter.hf_config(args)` of the
    run's args and of the args `hf_adapter.args_from_hf_config` reads from the file, so fields
    that config.json spells differently (rope_parameters vs rope_scaling, a missing head_dim)
    compare equal when they mean the same thing.
    """
    theirs = hf_adapter.hf_config(hf_adapter.args_from_hf_config(hf_config))
    ours = hf_adapter.hf_config(args)
    out = []
    for k in sorted(set(theirs) | set(ours)):
        if k in _NOT_ARCHITECTURE:
            continue
        a, b = theirs.get(k), ours.get(k)
        if _differs_loosely(a, b):
            out.append((k, a, b))
    return out


def _differs_loosely(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) != set(b) or any(_differs_loosely(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) != float(b)
    return a != b


def check_hf_config(folder: Path, *, hf_adapter: Any, args: Any, mismatch: str) -> None:
    """Compare folder/config.json's architecture with `args` (see load_initial)."""
    key = "checkpoint.initial_load_path"
    option = 'set checkpoint.hf_config_mismatch = "override" to train the recipe\'s model anyway'
    path = folder / "config.json"
    if not path.is_file():
        if mismatch == "override":
            _say(
                f"checkpoint: {path} not found; the architecture of the HF weights is not checked "
                "(checkpoint.hf_config_mismatch = override)"
            )
            return
        raise ConfigError(
            f"{key}: {path} not found, so the architecture of the weights cannot be checked; "
            f"allowed: a Hugging Face folder with config.json, or {option}"
        )
    try:
        hf_config = json.loads(path.read_text())
        diffs = hf_config_differences(hf_config, hf_adapter=hf_adapter, args=args)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{key}: cannot read {path}: {short_error(e)}; allowed: a readable JSON config.json"
        ) from None
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(
            f"{key}: {path} describes a model this trainer cannot build: {short_error(e)}; allowed: a config.json "
            "of a model family this trainer builds"
        ) from None
    if not diffs:
        return
    listed = ", ".join(f"{k}: config.json {_fmt(a)}, recipe {_fmt(b)}" for k, a, b in diffs[:4])
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    if mismatch == "error":
        raise ConfigError(
            f"{key}: the recipe's model differs from {path}: {listed}{more}; allowed: [model] "
            f"fields that match, or {option}"
        )
    for k, a, b in diffs:
        _say(f"checkpoint: hf_config_mismatch = override: {k} is {_fmt(b)} (recipe), not {_fmt(a)} ({path})")
