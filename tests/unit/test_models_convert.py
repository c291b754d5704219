"""scripts/convert.py: DCP <-> Hugging Face folders, checked through transformers' own loader."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers  # the [dev] extra; scripts/test.sh installs it, so HF checks never vanish as skips

import models  # noqa: E402
from trainer import hf_convert

_SPEC = importlib.util.spec_from_file_location("convert", Path(__file__).parents[2] / "scripts" / "convert.py")
convert = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(convert)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _our_model(family_name, flavor, **overrides):
    torch.manual_seed(0)
    family = models.get_model_family(family_name)
    model = family.model_cls(family.get_args(flavor, **overrides))
    model.init_weights()
    with torch.no_grad():  # norms away from 1 so a dropped norm weight would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _save_training_checkpoint(model, folder: Path) -> Path:
    """A checkpoint laid out like the trainer's: model under `model.`, plus other state."""
    step_dir = folder / "checkpoints" / "step-7"
    state = {"model": model.state_dict(), "optimizer": {"state.x": torch.randn(3)}, "step": 7}
    dcp.save(state, checkpoint_id=str(step_dir))
    return folder / "checkpoints"


@pytest.mark.parametrize(
    "family_name,flavor,overrides",
    [
        ("llama3", "debugmodel", dict(n_layers=2, tie_embeddings=True)),
        ("qwen3", "debugmodel_moe", dict(n_layers=2)),
    ],
)
def test_to_hf_loads_in_transformers(tmp_path, family_name, flavor, overrides):
    model = _our_model(family_name, flavor, **overrides)
    checkpoints = _save_training_checkpoint(model, tmp_path)
    out = tmp_path / "hf"
    cli = ["to-hf", "--checkpoint", str(checkpoints), "--model.name", family_name, "--model.flavor", flavor, str(out)]
    for k, v in overrides.items():  # both override spellings
        cli += [f"--model.{k}={json.dumps(v)}"] if isinstance(v, bool) else [f"--model.{k}", str(v)]
    assert convert.main(cli) == 0

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), atol=1e-5, rtol=0)
    if getattr(model.args, "num_experts", 0):
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "model.layers.1.mlp.experts.7.down_proj.weight" in set(f.keys())  # hub layout


def test_to_hf_shards_large_outputs(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    model = _our_model("llama3", "debugmodel", n_layers=3)
    checkpoints = _save_training_checkpoint(model, tmp_path)
    monkeypatch.setattr(hf_convert, "MAX_SHARD_BYTES", 2 * 1024**2)
    out = tmp_path / "hf"
    family = models.get_model_family("llama3")
    files = hf_convert.convert_to_hf(checkpoints, family, model.args, out, dtype=torch.bfloat16)
    assert len(files) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # The files hold our weights rounded to bf16 (torch's round to nearest even), bit for bit.
    stored = {}
    for f in files:
        stored.update(load_file(str(f)))
    want = family.hf_adapter.to_hf({k: v.bfloat16() for k, v in model.state_dict().items()}, model.args)
    assert stored.keys() == want.keys()
    for key, value in want.items():
        assert stored[key].dtype == torch.bfloat16 and torch.equal(stored[key], value), key
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, model.args.vocab_size, (1, 12))
    with torch.no_grad():
        # HF upcasts the bf16 values exactly, so against our model holding the same values both
        # sides compute fp32 on equal weights: they differ by the order of fp32 ops alone, a few
        # ulps (u = 2^-24) of intermediates that stay below ~10 here (logits |z| <= 4.5), i.e.
        # ~1e-6 through three layers (0 measured: the same ATen ops). Bound 1e-5, as the fp32
        # test above; the bf16 rounding itself moves these logits by 2.8e-2 (measured), so
        # pairing the wrong weights, rounded or not, fails by > 1000x.
        rounded = _our_model("llama3", "debugmodel", n_layers=3)
        rounded.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
        torch.testing.assert_close(hf_model(tokens).logits, rounded(tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("hf_config_kw", [dict(), dict(moe=True)])
def test_from_hf_round_trip(tmp_path, hf_config_kw):
    family = models.get_model_family("qwen3")
    args = family.get_args("debugmodel_moe" if hf_config_kw else "debugmodel", n_layers=2, tie_embeddings=True)
    config_dict = family.hf_adapter.hf_config(args)
    config_cls = transformers.Qwen3MoeConfig if hf_config_kw else transformers.Qwen3Config
    torch.manual_seed(0)
    hf_model = getattr(transformers, config_dict["architectures"][0])(config_cls(**config_dict)).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"))

    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    ours = family.model_cls(args)
    ours.init_weights()  # different random weights, then overwritten by the checkpoint
    state = {"model": ours.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    ours.load_state_dict(state["model"])
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)


def test_bad_input_exits_2(tmp_path, capsys):
    model = _our_model("llama3", "debugmodel", n_layers=2)
    checkpoints = _save_training_checkpoint(model, tmp_path)
    base = ["to-hf", "--checkpoint", str(checkpoints), "--model.name", "llama3"]
    cases = [
        (base + ["--model.flavor", "7B", str(tmp_path / "o")], "model.flavor"),
        (base + ["--model.flavor", "debugmodel", str(tmp_path / "o")], "are not in it (first: model.layers.2."),
        (
            base + ["--model.flavor", "debugmodel", "--model.n_layers=2", "--model.dim=128", str(tmp_path / "o")],
            "shape",
        ),
        (
            [
                "to-hf",
                "--checkpoint",
                str(tmp_path),
                "--model.name",
                "llama3",
                "--model.flavor",
                "debugmodel",
                str(tmp_path / "o"),
            ],
            "not a DCP checkpoint",
        ),
        (
            base + ["--model.flavor", "debugmodel", "--model.n_layers=two", str(tmp_path / "o")],
            "model.n_layers: expected an integer, got 'two'",
        ),
        (
            base
            + [
                "--model.flavor",
                "debugmodel",
                "--model.n_layers=2",
                "--model.rope_scaling_factor=abc",
                str(tmp_path / "o"),
            ],
            "model.rope_scaling_factor: expected a number or none, got 'abc'",
        ),
        # A checkpoint with MORE layers than the args (2 saved, 1 asked) used to convert silently.
        (
            base + ["--model.flavor", "debugmodel", "--model.n_layers=1", str(tmp_path / "o")],
            "it has 9 entries llama3 with model.flavor/overrides lacks (first: model.layers.1.",
        ),
        (["to-hf", "--model.name", "llama3", str(tmp_path / "o")], "required"),
        (["from-hf", str(tmp_path), str(tmp_path / "o")], "config.json"),
    ]
    for argv, needle in cases:
        assert convert.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
        assert not (tmp_path / "o").exists(), argv  # nothing written
    assert dataclasses.is_dataclass(model.args)


def test_string_overrides_use_the_trainer_parser(tmp_path):
    # --model.attn_backend=sdpa used to fail with "expected str" (the scripts had their own check).
    model = _our_model("llama3", "debugmodel", n_layers=2)
    checkpoints = _save_training_checkpoint(model, tmp_path)
    argv = [
        "to-hf",
        "--checkpoint",
        str(checkpoints),
        "--model.name",
        "llama3",
        "--model.flavor",
        "debugmodel",
        "--model.n_layers=2",
        "--model.attn_backend=sdpa",
        "--model.rope_scaling_factor=none",
        str(tmp_path / "o"),
    ]
    assert convert.main(argv) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["rope_scaling"] is None and config["num_hidden_layers"] == 2


def test_from_hf_refuses_weights_beyond_config(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    family = models.get_model_family("llama3")
    args = family.get_args("debugmodel", n_layers=2)
    model = family.model_cls(args)
    model.init_weights()
    (tmp_path / "hf").mkdir()
    tensors = {k: v.contiguous() for k, v in family.hf_adapter.to_hf(model.state_dict(), args).items()}
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    config = family.hf_adapter.hf_config(args)
    # config.json says 1 layer, the safetensors hold 2: the second layer used to be written into the DCP.
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks (first: layers.1." in err[0], err
    assert not (tmp_path / "dcp").exists()
    # Matching config: converts, with a manifest the trainer verifies.
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    from trainer.checkpoint import verify_checkpoint

    assert verify_checkpoint(tmp_path / "dcp") is True
    assert load_file(str(tmp_path / "hf" / "model.safetensors")).keys() == tensors.keys()
