"""HF weights at scale: per-rank sliced loading and streaming conversion (docs/checkpointing.md).

- A rank reads only the bytes of its own shards: the sliced load equals the full load bit for
  bit on FSDP, TP, FSDP x TP and EP meshes (thread ranks), each rank's bytes read equal the
  bytes of its local shards exactly, and a file holding none of its tensors is never opened.
- scripts/convert.py streams: HF -> DCP -> HF is bit-exact, and the peak resident memory a
  conversion adds stays under half the checkpoint plus a fixed margin (fresh subprocess).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models
from models.common.hf_adapter import read_box
from tests.conftest import linux_only
from tests.support.parallel_harness import full, run_threads
from tests.unit.test_parallel_fsdp import _parallel_model
from trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _write_hf_folder(folder: Path, family_name: str, args, *, dtype=torch.float32, split=None) -> dict:
    """config.json + safetensors of a seeded model of the family; `split(hf_key) -> file stem`
    spreads the tensors over several files with an index. Returns our full state dict."""
    from safetensors.torch import save_file

    family = models.get_model_family(family_name)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    with torch.no_grad():  # norms away from 1 so a dropped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf = {k: v.to(dtype).contiguous() for k, v in family.hf_adapter.to_hf(model.state_dict(), args).items()}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(family.hf_adapter.hf_config(args)))
    split = split or (lambda key: "model")
    files: dict[str, dict] = {}
    for key, value in hf.items():
        files.setdefault(split(key), {})[key] = value
    for stem, tensors in files.items():
        save_file(tensors, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": {k: f"{split(k)}.safetensors" for k in hf}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def _by_layer(key: str) -> str:
    return "model-layers" if ".layers." in key else "model-top"


def _by_expert(key: str) -> str:
    """Experts 0-3 in one file, 4-7 in another, the rest in a third (EP=2 ranks need one each)."""
    if ".experts." in key:
        return "model-experts-a" if int(key.split(".experts.")[1].split(".")[0]) < 4 else "model-experts-b"
    return "model-dense"


MESHES = [
    ("llama3", 2, dict(dp_shard=2), _by_layer),
    ("llama3", 2, dict(dp_shard=1, tp=2), _by_layer),
    ("llama3", 4, dict(dp_shard=2, tp=2), _by_layer),  # _StridedShard on dim 0
    ("qwen3_moe", 2, dict(dp_shard=2, ep=2), _by_expert),
]


@pytest.mark.parametrize("family, world_size, degrees, split", MESHES, ids=["fsdp2", "tp2", "fsdp2xtp2", "ep2_moe"])
def test_sliced_load_equals_full_load_and_reads_only_owned_bytes(
    tmp_path, monkeypatch, family, world_size, degrees, split
):
    family_name = "qwen3" if family == "qwen3_moe" else "llama3"
    fam = models.get_model_family(family_name)
    args = fam.get_args("debugmodel_moe" if family == "qwen3_moe" else "debugmodel", n_layers=2, max_seq_len=16)
    # bf16 on disk, fp32 parameters: the load casts, exactly (bf16 -> fp32 is exact).
    reference = _write_hf_folder(tmp_path / "hf", family_name, args, dtype=torch.bfloat16, split=split)

    reads: dict[int, list[tuple[str, int]]] = {}
    files: dict[int, set[str]] = {}
    lock = threading.Lock()
    original = ckpt.SafetensorsSlices.read

    def counting_read(self, name, slices):
        value = original(self, name, slices)
        with lock:
            rank = dist.get_rank() if dist.is_initialized() else 0
            reads.setdefault(rank, []).append((name, value.numel() * value.element_size()))
            files.setdefault(rank, set()).add(self.tensors[name][0].name)
        return value

    monkeypatch.setattr(ckpt.SafetensorsSlices, "read", counting_read)
    model_kw = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)

    def rank_fn():
        sliced, _, _ = _parallel_model(family_name, world_size, degrees, args=args, **model_kw)
        ckpt.load_initial(sliced, path=tmp_path / "hf", fmt="hf", hf_adapter=fam.hf_adapter, args=args)
        dense, _, _ = _parallel_model(family_name, world_size, degrees, args=args, **model_kw)
        # A bare from_hf has no layout: the old path, every rank reads everything.
        ckpt.load_initial(dense, path=tmp_path / "hf", fmt="hf", hf_adapter=fam.hf_adapter.from_hf, args=args)
        owned, mismatched = 0, []
        dense_params = dict(dense.named_parameters())
        for name, p in sliced.named_parameters():
            q = dense_params[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            if not torch.equal(local, q.to_local() if isinstance(q, DTensor) else q):
                mismatched.append(name)
            if not torch.equal(full(p), reference[name].float()):
                mismatched.append(name + " (vs reference)")
            owned += local.numel() * 2  # bf16 bytes of this rank's shard
        return mismatched, owned

    results = run_threads(world_size, rank_fn)
    for rank, (mismatched, owned) in enumerate(results):
        assert mismatched == [], (rank, mismatched[:4])
        # The sliced reads of this rank (the dense model's reads are not counted: load_file).
        assert sum(n for _, n in reads[rank]) == owned, rank
    total = sum(v.numel() * 2 for v in reference.values())
    if degrees == dict(dp_shard=2):  # pure FSDP: every byte of the file is read by exactly one rank
        assert sum(owned for _, owned in results) == total
    if "ep" in degrees:  # each EP rank opened the dense file and only its own experts' file
        assert files[0] == {"model-dense.safetensors", "model-experts-a.safetensors"}
        assert files[1] == {"model-dense.safetensors", "model-experts-b.safetensors"}


def test_layouts_tile_every_parameter_exactly_once():
    """Each family's hf_layout covers every element of each parameter exactly once (so a box read
    is complete and reads nothing twice), and applying it equals from_hf."""
    cases = [("llama3", "debugmodel", {}), ("qwen3", "debugmodel_moe", {}), ("flux", "debugmodel", {})]
    for family_name, flavor, kw in cases:
        fam = models.get_model_family(family_name)
        args = fam.get_args(flavor, **({"n_layers": 1} if family_name != "flux" else {}), **kw)
        torch.manual_seed(0)
        model = fam.model_cls(args)
        model.init_weights()
        hf = fam.hf_adapter.to_hf(model.state_dict(), args)
        layout = fam.hf_adapter.hf_layout({k: tuple(v.shape) for k, v in hf.items()}, args)
        for name, entry in layout.items():
            count = torch.zeros(entry.shape, dtype=torch.int32)
            for piece in entry.pieces:
                count[tuple(slice(s, s + n) for s, n in zip(piece.start, piece.shape))] += 1
            assert bool((count == 1).all()), (family_name, name)
            # An odd box (not aligned to any piece) reads the same values as the full tensor.
            start = tuple(n // 3 for n in entry.shape)
            shape = tuple(max(n - s - n // 5, 0) for s, n in zip(start, entry.shape))
            got = read_box(entry, start, shape, torch.float32, lambda k, sl: hf[k][sl])
            want = model.state_dict()[name][tuple(slice(s, s + n) for s, n in zip(start, shape))]
            assert torch.equal(got, want), (family_name, name)


def _convert():
    spec = importlib.util.spec_from_file_location("convert", ROOT / "scripts" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_streaming_round_trip_hf_dcp_hf_is_bit_exact(tmp_path):
    """HF (3 files + index, bf16, MoE per-expert layout) -> DCP -> HF: the same tensors, bit for bit."""
    from safetensors.torch import load_file

    from trainer import hf_convert as convert

    fam = models.get_model_family("qwen3")
    args = fam.get_args("debugmodel_moe", n_layers=2)
    _write_hf_folder(tmp_path / "hf", "qwen3", args, dtype=torch.bfloat16, split=_by_expert)
    name, args_back = convert.convert_from_hf(tmp_path / "hf", tmp_path / "dcp")
    assert name == "qwen3" and args_back.n_layers == 2
    files = convert.convert_to_hf(tmp_path / "dcp", fam, args_back, tmp_path / "back")
    original = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        original.update(load_file(str(f)))
    back = {}
    for f in files:
        back.update(load_file(str(f)))
    assert back.keys() == original.keys()
    for k, v in original.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_truncated_safetensors_is_one_error(tmp_path, capsys):
    """A file cut short (its data, not its header) is one ConfigError naming the folder, for the
    per-rank load and for from-hf (which then exits 2 with one `error:` line)."""
    from models.errors import ConfigError

    fam = models.get_model_family("llama3")
    args = fam.get_args("debugmodel", n_layers=1, max_seq_len=16)
    _write_hf_folder(tmp_path / "hf", "llama3", args)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path: cannot read .*hf"):
        ckpt.load_initial(fam.model_cls(args), path=tmp_path / "hf", fmt="hf", hf_adapter=fam.hf_adapter, args=args)
    assert _convert().main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "cannot read its safetensors" in err[0], err


# The memory bound: a fresh interpreter converts a tiny checkpoint first (so every module the
# conversion imports is loaded and not counted), then the measured one; "added" is the peak
# resident set (VmHWM) minus the resident set just before the measured call. Streaming holds
# one parameter (HF -> DCP) or one layer (DCP -> HF) plus DCP's read buffers; the model below
# has 12 equal layers of 7.6 MB (fp32, 93 MB in all), so that is ~25 MB with the buffers, while a
# non-streaming conversion holds the whole model at least once. Bound: model/2 + 16 MB; the
# margin (allocator slack, DCP bookkeeping) is ~6x smaller than the model, so any conversion
# that holds the model, or even half of it, fails.
_MEASURE = r"""
import sys, json
from pathlib import Path
sys.path.insert(0, {root!r})
from trainer import hf_convert as convert
import models
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def run(src, dst, args):
    if {kind!r} == "from-hf":
        convert.convert_from_hf(Path(src), Path(dst))
    else:
        fam = models.get_model_family("llama3")
        convert.convert_to_hf(Path(src), fam, fam.args_cls(**args), Path(dst))
run({warm_src!r}, {warm_dst!r}, {warm_args!r})
before = status("VmRSS")
run({src!r}, {dst!r}, {args!r})
print(json.dumps({{"before": before, "peak": status("VmHWM")}}))
"""


def measure_rss(kind: str, src: Path, dst: Path, args, warm_src: Path, warm_dst: Path, warm_args) -> dict:
    fields = lambda a: {f.name: getattr(a, f.name) for f in dataclasses.fields(a)}  # noqa: E731
    code = _MEASURE.format(
        root=str(ROOT),
        kind=kind,
        src=str(src),
        dst=str(dst),
        args=fields(args),
        warm_src=str(warm_src),
        warm_dst=str(warm_dst),
        warm_args=fields(warm_args),
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 15-35 s: two fresh interpreters (torch import) and a 93 MB checkpoint
@linux_only  # VmRSS / VmHWM from /proc/self/status
def test_streaming_conversion_peak_memory_is_bounded(tmp_path):
    fam = models.get_model_family("llama3")
    args = fam.get_args("debugmodel", n_layers=12, dim=384, n_heads=6, n_kv_heads=6, vocab_size=256, hidden_dim=1152)
    tiny = fam.get_args("debugmodel", n_layers=1, dim=64, n_heads=2, n_kv_heads=2, vocab_size=256, hidden_dim=128)
    _write_hf_folder(tmp_path / "hf", "llama3", args)
    _write_hf_folder(tmp_path / "tiny_hf", "llama3", tiny)
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    assert model_bytes > 90e6
    bound = model_bytes / 2 + 16 * 1024**2
    from_hf = measure_rss(
        "from-hf", tmp_path / "hf", tmp_path / "dcp", args, tmp_path / "tiny_hf", tmp_path / "tiny_dcp", tiny
    )
    assert from_hf["peak"] - from_hf["before"] < bound, (from_hf, model_bytes)
    to_hf = measure_rss(
        "to-hf", tmp_path / "dcp", tmp_path / "back", args, tmp_path / "tiny_dcp", tmp_path / "tiny_back", tiny
    )
    assert to_hf["peak"] - to_hf["before"] < bound, (to_hf, model_bytes)
    assert math.isclose(
        sum(f.stat().st_size for f in (tmp_path / "back").glob("*.safetensors")), model_bytes, rel_tol=1e-3
    )
    print(
        f"model {model_bytes / 1e6:.0f} MB; added: from-hf {(from_hf['peak'] - from_hf['before']) / 1e6:.0f} MB, "
        f"to-hf {(to_hf['peak'] - to_hf['before']) / 1e6:.0f} MB; bound {bound / 1e6:.0f} MB"
    )
