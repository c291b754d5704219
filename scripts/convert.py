"""Convert model weights between our DCP checkpoints and Hugging Face safetensors.

    python scripts/convert.py to-hf --checkpoint DIR --model.name llama3 --model.flavor 8B
        [--model.FIELD=VALUE ...] [--dtype bfloat16] [--hf-format fp8_blockwise] OUT_DIR
    python scripts/convert.py from-hf HF_DIR OUT_DCP_DIR [--dtype float32]

`to-hf` reads the model entries (DCP keys `model.<param>`) of a checkpoint directory
(`checkpoints/step-N`, or a `checkpoints` folder, whose latest step is used) one layer at a
time and writes `config.json` plus `model.safetensors` (sharded above 5 GB, with an index),
loadable by `AutoModelForCausalLM.from_pretrained`. `from-hf` reads `config.json` and the
safetensors of a Hugging Face model folder and writes a DCP checkpoint whose keys are
`model.<param>`, which `[checkpoint] initial_load_path` can load.

FP8 hub checkpoints (DeepSeek-V3, Kimi K2: float8_e4m3fn weights with a float32
`weight_scale_inv` per 128x128 block, config.json's `quantization_config` quant_method fp8):
`from-hf` dequantizes them (float32, or `--dtype`); `to-hf --hf-format fp8_blockwise` writes
that format (docs/low_precision.md, "FP8 hub checkpoints").

Both directions stream: the memory they need is about one layer, not the model. `to-hf`
plans every output file from the DCP metadata first (names, shapes and dtypes through the
adapter's `to_hf` on meta tensors), writes each file's safetensors header, then appends the
bytes of one layer at a time. `from-hf` reads the safetensors headers, builds a state dict of
meta tensors, and hands DCP a save planner whose `resolve_data` reads each parameter from the
safetensors (`safe_open` / `get_slice`) only when DCP writes it, one DCP file per tensor. FLUX (`--model.name flux`)
converts to and from a diffusers `FluxTransformer2DModel` folder (`config.json` with
`_class_name`, `diffusion_pytorch_model*.safetensors`), loadable by
`FluxTransformer2DModel.from_pretrained`. Runs in one process, no
process group. Bad input prints one `error:` line and exits with status 2.

Both directions write into a temporary folder beside OUT and rename it to OUT when every file
is written, holding a lock on OUT meanwhile (trainer/runtime/atomic.py, runlock.py): a failed or
killed conversion leaves nothing at OUT. OUT must be new or an empty folder (else exit 2); a
second conversion into the same OUT is refused naming the first (exit 2); a failed write (disk
full, file too large, permission) is one `error:` line with the errno text, exit 1.
"""

# The conversions are trainer/hf_convert.py's; this script reads the command line (its --help is
# the docstring above).
import argparse
import sys
import typing
from pathlib import Path

import torch

from models.errors import ConfigError
from trainer.config import ModelConfig, coerce, model_args, parse_value  # the trainer's own parser
from trainer.hf_convert import MODEL_PREFIX, convert_from_hf, convert_to_hf
from trainer.runtime import cli
from trainer.runtime.atomic import WriteFailed

# [model] keys of a run that are not fields of the model's args (see trainer.config.ModelConfig).
_RUN_ONLY_MODEL_KEYS = {
    name: typ for name, typ in typing.get_type_hints(ModelConfig).items() if name not in ("name", "flavor", "overrides")
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _split_model_overrides(argv: list[str]) -> tuple[list[str], dict]:
    """Take `--model.FIELD=VALUE` / `--model.FIELD VALUE` (not name/flavor) out of argv; values are
    parsed like the trainer's (`trainer.config.parse_value`) and checked by `model_args`. The other
    `[model]` config keys (tokenizer, attn_backend) are accepted, as on the trainer's command line,
    and change nothing about the weights: they are checked and dropped."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        item = argv[i]
        key, sep, value = item[len("--model.") :].partition("=")
        if not item.startswith("--model.") or key in ("name", "flavor"):
            rest.append(item)
            i += 1
            continue
        if not sep:
            if i + 1 >= len(argv):
                raise ConfigError(f"{item}: missing value; allowed: {item}=VALUE or {item} VALUE")
            value, i = argv[i + 1], i + 1
        if key in _RUN_ONLY_MODEL_KEYS:
            coerce(f"model.{key}", parse_value(value), _RUN_ONLY_MODEL_KEYS[key])
        else:
            overrides[key] = parse_value(value)
        i += 1
    return rest, overrides


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ConfigError(f"--dtype: {name!r} unknown; allowed: {list(_DTYPES)}")
    return _DTYPES[name]


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_to = sub.add_parser("to-hf", help="DCP checkpoint -> Hugging Face folder")
    p_to.add_argument("--checkpoint", required=True, type=Path, help="checkpoints/step-N (or checkpoints/)")
    p_to.add_argument("--model.name", dest="model_name", required=True)
    p_to.add_argument("--model.flavor", dest="model_flavor", required=True)
    p_to.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as stored")
    p_to.add_argument(
        "--hf-format",
        dest="hf_format",
        default="default",
        help="default: every weight as stored (or --dtype); fp8_blockwise: the FP8 hub format of "
        "DeepSeek-V3 / Kimi K2 (deepseek_v3 only): attention, MLP and expert linears as float8_e4m3fn "
        "with a float32 weight_scale_inv = amax/448 per 128x128 block, config.json's quantization_config "
        "fp8; the other tensors as stored (or --dtype)",
    )
    p_to.add_argument("out", type=Path)
    p_from = sub.add_parser("from-hf", help="Hugging Face folder -> DCP checkpoint")
    p_from.add_argument("hf_dir", type=Path)
    p_from.add_argument("out", type=Path)
    p_from.add_argument("--dtype", default=None, help="cast weights; default: as stored in the safetensors")

    try:
        argv, overrides = _split_model_overrides(list(sys.argv[1:] if argv is None else argv))
        ns = parser.parse_args(argv)
        if ns.command == "to-hf":
            family, args = model_args(ns.model_name, ns.model_flavor, overrides)
            files = convert_to_hf(ns.checkpoint, family, args, ns.out, dtype=_dtype(ns.dtype), hf_format=ns.hf_format)
            print(f"wrote {ns.out}: config.json + {len(files)} safetensors file(s)")
        else:
            if overrides:
                raise ConfigError(
                    f"--model.{next(iter(overrides))}: from-hf takes the model from config.json; allowed: no --model.* "
                    "field overrides with from-hf"
                )
            name, args = convert_from_hf(ns.hf_dir, ns.out, dtype=_dtype(ns.dtype))
            print(f"wrote DCP checkpoint {ns.out} (keys {MODEL_PREFIX}*); model.name={name}, args={args}")
    except ConfigError as e:
        cli.error_line(str(e))
        return 2
    except WriteFailed as e:  # disk full, file too large, permission: the destination is untouched
        cli.error_line(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
