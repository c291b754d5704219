"""The `hf` family: any `transformers` causal LM from a local config.json, under our trainer.

Architectures: tiny random configs of the classes transformers ships (tests/support/hf_configs.py).
In-process tests check the model against `transformers` itself (names, parameter counts, logits,
init, HF safetensors round trip) and the `error:` lines. The end-to-end tests train through
`trainer.train` in fp32 and compare loss trajectories; their bound is 1e-5 relative, as in
test_parallel_e2e.py: every variant (AC, per-block compile, the captured graph, layer scan,
SimpleFSDP over 2 ranks, TP over 2 ranks) computes the same fp32 math in a different order or
with different collectives, which moves a loss by a few ulps (~1e-7 relative) per step; a wrong
shard, a missing gradient reduction or a wrong layer order shows as >= 1e-3.
To keep the 2-core CI machine's cost down, each matrix runs all its architectures in ONE process
or ONE torchrun launch (tests/support/hf_matrix.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from models import get_model_family
from models.errors import ConfigError
from tests.support.hf_configs import CONFIGS, write_config
from tests.support.trainer_runs import ENV, REPO, launch_command

# The training matrix (slow tests) runs, by default, four architectures that cover every path:
# Llama (TP, scan), Qwen3-MoE (aux loss, scan and TP refused), Gemma 3 (alternating layers,
# tied head), GPT-NeoX (non-Llama layout, parallel residual), so the suite stays within its time
# budget. HF_TEST_ARCHS=all runs all nine (docs/hf_backend.md has that run's table);
# HF_TEST_ARCHS=a,b picks some. The in-process tests above the matrix cover all nine always.
_DEFAULT_ARCHS = "llama,qwen3_moe,gemma3_text,gpt_neox"
_chosen = os.environ.get("HF_TEST_ARCHS", _DEFAULT_ARCHS)
ARCHS = list(CONFIGS) if _chosen == "all" else [a for a in _chosen.split(",") if a]
FAMILY = get_model_family("hf")
SEQ, BATCH, STEPS = 32, 4, 3


def _args(tmp_path, arch):
    return FAMILY.get_args("config", hf_config=write_config(str(tmp_path), arch))


def _built(args, *, seed=0):
    """Our model, built on meta and materialized + initialised as the trainer does."""
    with torch.device("meta"):
        model = FAMILY.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _reference(args):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(args.config(), attn_implementation="sdpa", dtype=torch.float32)


# --- in-process: the model against transformers ---------------------------------------------


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_names_counts_and_logits_match_transformers(tmp_path, arch):
    """State-dict keys are HF's; counts are the built model's; logits equal the HF forward's.

    The logits bound is 1e-6 absolute: both run the very same modules and kernels (only the
    layer loop differs), so any difference is an op-order change, not a different model.
    """
    args = _args(tmp_path, arch)
    ours = _built(args)
    ref = _reference(args)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert args.num_params() == sum(p.numel() for p in ours.parameters())
    shape = args.shape()
    if shape.is_moe:
        assert args.num_active_params() < args.num_params()
    else:
        assert args.num_active_params() == args.num_params()
    ref.load_state_dict(ours.state_dict())
    ours.eval(), ref.eval()
    tokens = torch.randint(0, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(tokens), ref(input_ids=tokens, use_cache=False).logits
    assert got.shape == (2, 16, shape.vocab_size)
    assert (got - want).abs().max().item() <= 1e-6
    if shape.is_moe:  # HF's own load-balancing loss, as its forward computes it
        with torch.no_grad():
            want_aux = ref(input_ids=tokens, use_cache=False, output_router_logits=True).aux_loss
        got_aux = ours.pop_aux_loss()
        assert got_aux is not None and ours.pop_aux_loss() is None
        assert abs(got_aux.item() - want_aux.item()) <= 1e-6
    else:
        assert ours.pop_aux_loss() is None


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_neox"])
def test_init_weights_follows_transformers_and_rebuilds_rope(tmp_path, arch):
    """After to_empty (garbage) init_weights gives HF's init: rotary inv_freq exactly HF's (it is
    non-persistent, so only init rebuilds it), norms at HF's constant, projections with std
    initializer_range (0.02) within 10% (thousands of samples: the std estimate is within ~3%)."""
    args = _args(tmp_path, arch)
    ours = _built(args)
    ref = _reference(args)
    ref_buffers = dict(ref.named_buffers())
    for name, buf in ours.named_buffers():
        if "inv_freq" in name:
            torch.testing.assert_close(buf, ref_buffers[name], rtol=0, atol=0)
    ref_sd = ref.state_dict()
    for name, p in ours.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name and name.endswith("weight"):
            assert torch.equal(p, ref_sd[name]), name  # a constant (ones, or zeros for Gemma)
        elif name.endswith("weight") and p.dim() == 2 and p.numel() >= 1024:
            assert abs(p.std().item() - 0.02) < 0.002, (name, p.std().item())
    tied = [n for n, _ in ours.named_parameters(remove_duplicate=False)]
    if CONFIGS[arch].get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.get_submodule("model.embed_tokens").weight
        assert len(tied) == len(list(ours.parameters())) + 1


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_hf_safetensors_load_and_save(tmp_path, arch):
    """HF's own save_pretrained folder loads through the trainer's HF path (`load_initial`) with
    every tensor equal, and `to_hf` gives back exactly HF's keys (a tied matrix once)."""
    from trainer.checkpoint import load_initial

    args = _args(tmp_path, arch)
    torch.manual_seed(3)
    ref = _reference(args)
    ref.save_pretrained(tmp_path / "hf_weights")
    ours = _built(args, seed=4)
    load_initial(ours, path=tmp_path / "hf_weights", fmt="hf", hf_adapter=FAMILY.hf_adapter, args=args)
    ref_sd = ref.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, ref_sd[name]), name
    saved = FAMILY.hf_adapter.to_hf(ours.state_dict(), args)
    from safetensors.torch import load_file

    assert set(saved) == set(load_file(str(tmp_path / "hf_weights" / "model.safetensors")))


def test_hub_kernel_routing_is_bypassed_for_scan(tmp_path):
    """transformers >= 5.25 with Hugging Face's `kernels` installed wraps attention forwards in a
    hub-kernel router that writes a global on each compiled call, which a scan body cannot capture.
    Our model runs those modules' plain forwards, and a layer scan traces (fullgraph, no graph
    break) and gives the unrolled stack's logits exactly (same ops, same order)."""
    pytest.importorskip("kernels")  # Hugging Face's package (ours is titan_kernels)
    model = _built(_args(tmp_path, "llama"))
    routed = [m for m in model.modules() if "_kernel_funcs" in vars(m)]
    if not routed:
        pytest.skip("this transformers applies no hub-kernel routing")
    for module in routed:
        assert module.forward.__func__ is type(module).forward.__wrapped__, type(module).__name__
    tokens = torch.randint(0, model.args.shape().vocab_size, (2, 16))
    with torch.no_grad():
        want = model(tokens)
        model.layers.enable_scan()
        got = torch.compile(model, backend="eager", fullgraph=True)(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scan_refused_for_alternating_layers(tmp_path):
    """Gemma 3 alternates sliding and global attention layers: scan would run layer 0's kind for
    all, so it is refused with a ConfigError naming the key."""
    model = _built(_args(tmp_path, "gemma3_text"))
    with pytest.raises(ConfigError, match="compile.scan_layers: .*sliding_attention"):
        model.layers.enable_scan()


def test_scan_refused_for_hf_moe_layers(tmp_path):
    """HF MoE layers hand their router logits to hooks (a side effect a scan body cannot have);
    the native Qwen 3 MoE blocks scan, the HF ones are refused with a ConfigError naming the key."""
    model = _built(_args(tmp_path, "qwen3_moe"))
    with pytest.raises(ConfigError, match="compile.scan_layers: the MoE layers"):
        model.layers.enable_scan()


def test_recipe_overrides_layers_and_vocab(tmp_path):
    """`[model] n_layers` keeps the first layers (and cuts Gemma 3's layer_types to match);
    more layers than the config has is an error naming the key."""
    from trainer.config import model_args

    folder = write_config(str(tmp_path), "gemma3_text")
    _, args = model_args("hf", "config", {"hf_config": folder, "n_layers": 1, "vocab_size": 5000})
    assert (args.n_layers, args.vocab_size, args.shape().n_layers) == (1, 5000, 1)
    assert args.config().layer_types == ["sliding_attention"]
    with torch.device("meta"):
        model = FAMILY.model_cls(args)
    assert list(model.layers) and len(model.layers) == 1
    assert model.get_submodule("model.embed_tokens").weight.shape[0] == 5000
    with pytest.raises(ConfigError, match=r"^model.n_layers: 3 is more than the config's 2"):
        model_args("hf", "config", {"hf_config": folder, "n_layers": 3})


def test_config_errors(tmp_path):
    from trainer.config import build_config, resolve_model_args

    with pytest.raises(ConfigError, match=r"^model.hf_config: required"):
        build_config("configs/llama3_debug.toml", [("model.name", "hf"), ("model.flavor", "config")])
    with pytest.raises(ConfigError, match=r"^model.hf_config: only used with model.name"):
        build_config("configs/llama3_debug.toml", [("model.hf_config", str(tmp_path))])
    cfg = build_config(
        "configs/llama3_debug.toml",
        [("model.name", "hf"), ("model.flavor", "config"), ("model.hf_config", str(tmp_path / "nope"))],
    )
    with pytest.raises(ConfigError, match=r"^model.hf_config: .*nope.* is not a config.json"):
        resolve_model_args(cfg.model, seq_len=32)
    # TP with an architecture whose plan does not translate: a step-plan rule, refused by plan_job
    # (tests/unit/test_step_plan.py::test_tp_on_an_hf_model_without_a_plan_is_a_rule).


def test_bad_hf_config_is_one_error_line(tmp_path):
    proc = subprocess.run(
        launch_command(
            1,
            [
                "--config",
                "configs/llama3_debug.toml",
                "--model.name=hf",
                "--model.flavor=config",
                f"--model.hf_config={tmp_path}/missing",
                f"--job.dump_folder={tmp_path}/out",
            ],
        ),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith("error: model.hf_config: "), proc.stderr


# --- end to end: the architecture x mode matrix through trainer.train ------------------------

MODES = {
    "eager": [],
    "ac": ["--activation_checkpoint.mode=full"],
    "compile": ["--compile.mode=compile", "--compile.backend=aot_eager"],
    "graph": ["--compile.mode=graph", "--compile.backend=aot_eager"],
    "scan": [
        "--compile.mode=graph",
        "--compile.backend=aot_eager",
        "--compile.scan_layers=true",
        "--compile.dump_graph=graph.txt",
    ],
}
# Refused with an `error:` line, by design (docs/hf_backend.md): scan needs uniform layers without
# router logits collected by hooks during forward; TP needs a translatable base_model_tp_plan and uniform masks.
SCAN_REFUSED = {"gemma3_text", "qwen3_moe"}
TP_ARCHS = ["llama", "qwen3", "mistral", "gpt_neox", "starcoder2"]


def _argv(folder, arch_dir, *extra):
    return [
        "--config",
        "configs/llama3_debug.toml",
        "--model.name=hf",
        "--model.flavor=config",
        f"--model.hf_config={arch_dir}",
        f"--training.steps={STEPS}",
        f"--training.seq_len={SEQ}",
        "--metrics.log_freq=1",
        "--checkpoint.enable=false",
        "--validation.enable=false",
        "--training.mixed_precision_param=float32",
        "--metrics.enable_tensorboard=false",
        "--lr_scheduler.warmup_steps=1",
        f"--job.dump_folder={folder}",
        *extra,
    ]


def run_matrix(tmp_path, jobs: dict[str, list[str]], nproc: int = 1) -> dict[str, dict]:
    """Run `jobs` (name -> trainer argv) in one process / one torchrun launch (tests/support/hf_matrix.py)."""
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    if nproc == 1:
        cmd = [sys.executable, "-m", "tests.support.hf_matrix", str(jobs_file), str(results_file)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "tests.support.hf_matrix",
            str(jobs_file),
            str(results_file),
        ]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results_file.read_text())


def _close(got: list[float], want: list[float], bound: float = 1e-5) -> float:
    assert len(got) == len(want) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst < bound, (got, want)
    return worst


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Every architecture in every mode, 1 process, local batch 4: {"arch/mode": result}
    (each result also holds `folder`, its dump folder)."""
    tmp = tmp_path_factory.mktemp("hf_matrix")
    jobs = {
        f"{arch}/{mode}": _argv(
            tmp / f"{arch}_{mode}", write_config(str(tmp), arch), f"--training.local_batch_size={BATCH}", *flags
        )
        for arch in ARCHS
        for mode, flags in MODES.items()
    }
    results = run_matrix(tmp, jobs)
    for name, result in results.items():
        result["folder"] = str(tmp / name.replace("/", "_"))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_modes_match_eager(single_process, arch):
    """AC, per-block compile, graph mode and (uniform layers) layer scan give eager's losses."""
    eager = single_process[f"{arch}/eager"]["losses"]
    assert all(x == x for x in eager)
    for mode in MODES:
        result = single_process[f"{arch}/{mode}"]
        if mode == "scan" and arch in SCAN_REFUSED:
            assert result.get("refused", "").startswith("error: compile.scan_layers: "), result
            continue
        assert "losses" in result, result
        _close(result["losses"], eager)
        if mode == "scan":  # really scanned: one copy of the layer in the captured graph
            with open(os.path.join(result["folder"], "graph.txt")) as f:
                assert "higher_order.scan" in f.read()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_two_ranks_match_one(single_process, tmp_path):
    """SimpleFSDP over 2 gloo ranks (dp_shard=2, local batch 2 = the same global batch of 4)
    gives the 1-process losses for every architecture (one torchrun launch for all). Dense models
    agree to ~1e-7; the MoE model to ~4e-6, because its load-balancing loss is a product of
    batch means computed per rank (as in any data-parallel MoE), still inside the 1e-5 bound."""
    jobs = {
        arch: _argv(
            tmp_path / arch,
            write_config(str(tmp_path), arch),
            f"--training.local_batch_size={BATCH // 2}",
            "--parallelism.data_parallel_shard_degree=2",
        )
        for arch in ARCHS
    }
    results = run_matrix(tmp_path, jobs, nproc=2)
    for arch in ARCHS:
        assert "losses" in results[arch], (arch, results[arch])
        _close(results[arch]["losses"], single_process[f"{arch}/eager"]["losses"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp_two_ranks_match_one(single_process, tmp_path):
    """TP=2 from the model's own base_model_tp_plan (eager and graph mode) gives the 1-process
    losses; architectures without a translatable plan are refused with an `error:` line."""
    jobs = {}
    for arch in ARCHS:
        modes = ("eager", "graph") if arch in TP_ARCHS else ("eager",)
        for mode in modes:
            jobs[f"{arch}/{mode}"] = _argv(
                tmp_path / f"{arch}_{mode}",
                write_config(str(tmp_path), arch),
                f"--training.local_batch_size={BATCH}",
                "--parallelism.tensor_parallel_degree=2",
                "--parallelism.data_parallel_shard_degree=1",
                *MODES[mode],
            )
    results = run_matrix(tmp_path, jobs, nproc=2)
    for name, result in results.items():
        arch, mode = name.split("/")
        if arch in TP_ARCHS:
            assert "losses" in result, (name, result)
            _close(result["losses"], single_process[f"{arch}/eager"]["losses"])
        else:
            assert result.get("refused", "").startswith("error: parallelism.tensor_parallel_degree: "), result


# --- the hf path against the native families, on the same weights ----------------------------


def _native_weights(tmp_path, family_name: str, overrides: dict) -> str:
    """A HF folder (config.json from the native family's adapter + HF-initialised safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = get_model_family(family_name)
    args = family.get_args("debugmodel", **overrides)
    raw = family.hf_adapter.hf_config(args)
    folder = tmp_path / f"{family_name}_weights"
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_hf_path_matches_native_families(tmp_path):
    """Llama 3 and Qwen 3: the `hf` family and our native family (loading the same HF safetensors
    through its adapter) train to the same losses. Bound 1e-5 relative: the same math in fp32,
    through different kernels (HF's SDPA call vs ours, fused vs separate projections), ~1e-7
    per op; a layout or RoPE difference would be >= 1e-3."""
    jobs = {}
    for family_name in ("llama3", "qwen3"):
        overrides = {"n_layers": 2, "max_seq_len": SEQ}
        weights = _native_weights(tmp_path, family_name, overrides)
        load = [
            f"--checkpoint.initial_load_path={weights}",
            "--checkpoint.initial_load_format=hf",
            f"--training.local_batch_size={BATCH}",
        ]
        jobs[f"{family_name}/hf"] = _argv(tmp_path / f"{family_name}_hf", weights, *load)
        native = _argv(tmp_path / f"{family_name}_native", weights, *load, "--model.attn_backend=sdpa")
        native[native.index("--model.name=hf")] = f"--model.name={family_name}"
        native[native.index("--model.flavor=config")] = "--model.flavor=debugmodel"
        native.remove(f"--model.hf_config={weights}")
        native += ["--model.n_layers=2"]
        jobs[f"{family_name}/native"] = native
    results = run_matrix(tmp_path, jobs)
    for family_name in ("llama3", "qwen3"):
        hf, native = results[f"{family_name}/hf"], results[f"{family_name}/native"]
        assert "losses" in hf and "losses" in native, (hf, native)
        _close(hf["losses"], native["losses"])
