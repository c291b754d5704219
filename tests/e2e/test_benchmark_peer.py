"""The peer harness and scripts/benchmark.py's --peer path, with a fake peer: no TorchTitan, no network.

What runs TorchTitan for real is scripts/bench/reference_torchtitan.py in the peer venv (docs/benchmarks.md);
here we check everything around it that can be wrong without it: the command lines, the parsing of
TorchTitan's log into our metrics schema, the interleaving, the ratio column, the CPU/thread record,
and that our recipe really has TorchTitan's debugmodel shape.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """scripts/benchmark.py's runner (tools/benchmark.py): commands, runs, summaries."""
    from tools import benchmark

    return benchmark


@pytest.fixture(scope="module")
def script():
    """scripts/benchmark.py itself (its main)."""
    return _load("benchmark_script_peer", ROOT / "scripts" / "benchmark.py")


@pytest.fixture(scope="module")
def harness():
    return _load("reference_torchtitan_script", ROOT / "scripts" / "bench" / "reference_torchtitan.py")


# TorchTitan 0.3.0's metric line as its MetricsProcessor.log formats it (with and without colours, and
# with torchrun's --local-ranks-filter prefix), a validation line (no grad_norm: must not count) and noise.
TT_LOG = """\
[titan] 2026-12-01 17:14:49,564 - root - INFO - Building llama3 debugmodel
[titan] 2026-12-01 17:17:19,108 - root - INFO - step:  1  loss:  8.09498  grad_norm:  0.3960  memory: -0.00GiB(-0.00%)  tps: 356  tflops: 0.03  mfu: 0.01%
[rank0]:[titan] 2026-12-01 17:17:29,108 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  7.50000  \x1b[33mgrad_norm:  1.2500  \x1b[36mmemory:  0.00GiB(0.00%)  \x1b[34mtps: 1,632  \x1b[36mtflops: 0.12  \x1b[35mmfu: 0.04%\x1b[39m
[titan] 2026-12-01 17:17:30,000 - root - INFO - validate step:  2  loss:  7.4000  memory:  0.00GiB(0.00%)  tps: 9,999
[titan] 2026-12-01 17:17:39,108 - root - INFO - step:  3  loss:  7.00000  grad_norm:  0.9000  memory:  0.00GiB(0.00%)  tps: 1,728  tflops: 0.13  mfu: N/A
[titan] 2026-12-01 17:17:49,108 - root - INFO - step:  4  loss:  6.90000  grad_norm:  0.8000  memory:  0.00GiB(0.00%)  tps: 1,700  tflops: 0.12  mfu: 0.04%
"""


def test_parse_torchtitan_log(harness):
    records = harness.parse_torchtitan_log(TT_LOG, keep_mfu=False)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the validation line is not a step
    assert [r["tokens_per_sec"] for r in records] == [356.0, 1632.0, 1728.0, 1700.0]  # thousands commas
    assert records[1]["loss"] == 7.5 and records[1]["grad_norm"] == 1.25 and records[1]["tflops"] == 0.12
    assert all(r["mfu_pct"] is None for r in records)  # CPU: TorchTitan divides by an A100 peak
    kept = harness.parse_torchtitan_log(TT_LOG, keep_mfu=True)
    assert kept[1]["mfu_pct"] == 0.04 and kept[2]["mfu_pct"] is None  # "N/A" stays unknown
    assert harness.parse_torchtitan_log("no metric lines\n", keep_mfu=True) == []


def test_peer_commands(harness, bench):
    cmd = harness.build_peer_command(
        python="py",
        nproc=2,
        dump_folder="/d/tt",
        steps=7,
        seq_len=2048,
        batch=8,
        tokenizer_dir="/tok",
        data_dir="/data",
        extra=["--training.dtype", "float32"],
    )
    # TorchTitan's own launch (torchrun, as run_train.sh) of its own entry point through the shim.
    assert cmd[:6] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--local-ranks-filter=0",
    ]
    assert cmd[6] == str(ROOT / "scripts" / "bench" / "peer" / "torchtitan_cpu_shim.py")
    pairs = dict(zip(cmd[7::2], cmd[8::2]))
    assert (
        pairs["--module"] == "scripts.bench.peer.torchtitan_cpu_shim" and pairs["--config"] == "llama3_debugmodel_sdpa"
    )
    for flag, value in [
        ("--training.steps", "7"),
        ("--training.seq-len", "2048"),
        ("--training.local-batch-size", "8"),
        ("--hf-assets-path", "/tok"),
        ("--dataloader.dataset-path", "/data"),
        ("--dump-folder", "/d/tt"),
        ("--metrics.log-freq", "1"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert {"--checkpoint.no-enable", "--validator.no-enable", "--metrics.no-enable-tensorboard"} <= set(cmd)
    assert cmd[-2:] == ["--training.dtype", "float32"]

    run = bench.build_peer_command(
        peer="torchtitan",
        python="/peer/python",
        nproc=1,
        dump_folder="/d",
        steps=9,
        warmup=2,
        seq_len=256,
        batch=2,
        extra=["--x", "1"],
    )
    assert run[:2] == ["/peer/python", str(ROOT / "scripts" / "bench" / "reference_torchtitan.py")]
    assert run[run.index("--steps") + 1] == "9" and run[run.index("--warmup") + 1] == "2"
    assert run[run.index("--seq-len") + 1] == "256" and run[-3:] == ["--", "--x", "1"]
    with pytest.raises(SystemExit):
        bench.build_peer_command(
            peer="megatron", python="p", nproc=1, dump_folder="/d", steps=9, warmup=2, seq_len=1, batch=1, extra=[]
        )


def test_peer_ratio(bench):
    rows = [
        {"variant": "eager", "nproc": 1, "tokens_per_sec": 3000.0},
        {"variant": "eager", "nproc": 2, "tokens_per_sec": 2000.0},
        {"variant": "graph", "nproc": 1, "tokens_per_sec": None},
        {"variant": "torchtitan", "nproc": 1, "tokens_per_sec": 1500.0},
    ]
    out = {(r["variant"], r["nproc"]): r["vs_peer"] for r in bench.add_peer_ratio(rows, "torchtitan")}
    assert out[("eager", 1)] == 2.0 and out[("torchtitan", 1)] == 1.0
    assert out[("eager", 2)] is None  # no peer run at 2 processes: no ratio, not a ratio against nproc 1
    assert out[("graph", 1)] is None
    assert "vs_peer" not in bench.add_peer_ratio([{"variant": "eager", "nproc": 1}], None)[0]


FAKE_RUN = """\
import json, sys
folder, tps = sys.argv[sys.argv.index("--dump-folder") + 1], float(sys.argv[sys.argv.index("--tps") + 1])
with open(folder + "/metrics.jsonl", "w") as f:
    for step in range(1, 5):
        f.write(json.dumps({"step": step, "loss": 5.0, "tokens_per_sec": tps if step > 1 else 1.0}) + "\\n")
"""


def test_benchmark_main_with_fake_peer(bench, script, tmp_path, monkeypatch):
    """main(): our variants and the peer interleaved per repeat; the CSV has the ratio, CPU and threads."""
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    ours_tps = {"fast": 3000.0, "slow": 1200.0}

    def fake_ours(*, recipe, overrides, nproc, dump_folder, steps, extra, python=sys.executable):
        return [sys.executable, str(fake), "--dump-folder", dump_folder, "--tps", str(ours_tps[overrides[0]])]

    monkeypatch.setattr(bench, "build_command", fake_ours)
    monkeypatch.setattr(bench, "PEER_SCRIPT", fake)  # the peer python runs the fake instead of the harness
    monkeypatch.setattr(bench, "wait_until_quiet", lambda *a: 0.0)
    out = tmp_path / "b.csv"
    rc = script.main(
        [
            "--config",
            "r.toml",
            "--variants=",
            "--variant",
            "a=fast",
            "--variant",
            "b=slow",
            "--peer",
            "torchtitan",
            "--peer-python",
            sys.executable,
            "--peer-arg=--tps",
            "--peer-arg=1500",
            "--repeats",
            "2",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--dump-root",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    with open(out) as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert float(rows["torchtitan"]["tokens_per_sec"]) == 1500.0
    assert float(rows["a"]["vs_peer"]) == 2.0 and float(rows["b"]["vs_peer"]) == 0.8
    assert rows["a"]["threads"] == "1" and rows["a"]["cpu_model"] == rows["torchtitan"]["cpu_model"] != ""
    with open(tmp_path / "b_runs.csv") as f:
        order = [(r["variant"], r["repeat"]) for r in csv.DictReader(f)]
    assert order == [("a", "0"), ("b", "0"), ("torchtitan", "0"), ("a", "1"), ("b", "1"), ("torchtitan", "1")]


def test_benchmark_peer_venv_missing_is_a_clean_error(script, tmp_path, capsys):
    rc = script.main(
        [
            "--config",
            "r.toml",
            "--peer",
            "torchtitan",
            "--peer-python",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "o.csv"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --peer-python") and "peer_env.sh" in err[0]


def test_preset_commands(bench, script, capsys):
    """--preset ttshape --quick: six variants of ours on the TT-shape recipe, then the peer, at one shape."""
    assert script.main(["--preset", "ttshape", "--quick", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7 and "reference_torchtitan.py" in lines[-1]
    assert all("configs/llama3_debug_ttshape.toml" in line for line in lines[:6])
    assert sum("--training.mixed_precision_param=float32" in line for line in lines) == 3
    assert sum("--compile.scan_layers=true" in line for line in lines) == 2
    seq, batch = bench.QUICK["seq_len"], bench.QUICK["batch"]
    assert all(f"--training.seq_len={seq}" in line for line in lines[:6])
    assert f"--seq-len {seq} --batch {batch}" in lines[-1]


def test_ttshape_recipe_is_torchtitans_debugmodel():
    """Our model from configs/llama3_debug_ttshape.toml has TorchTitan 0.3.0's debugmodel shape.

    TorchTitan logs "Model llama3 debugmodel size: 6,163,712 total parameters" for it: embeddings
    2 x 2048 x 256, per layer 4 x 256^2 (attention, no GQA) + 3 x 256 x 768 (SwiGLU) + 2 x 256 (norms),
    6 layers, final norm 256. An exact count, so any difference in dim, layers, kv heads, FFN width or
    vocabulary fails it.
    """
    import torch

    from trainer.config import build_config, resolve_model_args
    from trainer.data.tokenizer import build_tokenizer

    cfg = build_config(str(ROOT / "configs" / "llama3_debug_ttshape.toml"), [])
    _, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    assert (args.dim, args.n_layers, args.n_heads, args.num_kv_heads) == (256, 6, 16, 16)
    assert (args.vocab_size, args.ffn_hidden_dim, args.rope_theta) == (2048, 768, 500000.0)
    assert (cfg.training.seq_len, cfg.training.local_batch_size) == (2048, 8)
    from models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 6_163_712
    tokenizer = build_tokenizer(str(ROOT / cfg.model.tokenizer))
    assert tokenizer.n_vocab == 2048  # the shared 2,048-token BPE fills the vocabulary exactly


def test_shim_cpu_device_module():
    """The shim's CPU stand-in answers every call TorchTitan's trainer and metrics make on its device module."""
    shim = _load("torchtitan_cpu_shim", ROOT / "scripts" / "bench" / "peer" / "torchtitan_cpu_shim.py")
    module = shim._cpu_device_module()
    assert module.current_device() == 0  # barrier(device_ids=[...]) takes integers
    assert module.memory_stats() == {} and module.device_count() == 1
    assert module.get_device_properties(0).total_memory > 0  # metrics divide by it
    module.set_device("cpu"), module.reset_peak_memory_stats(), module.empty_cache(), module.synchronize()


def test_moe_peer_commands(harness):
    """--model qwen3_moe runs TorchTitan's own MoE config through the shim; --routing balanced is its round-robin."""
    common = dict(
        python="py", nproc=1, dump_folder="/d", steps=4, seq_len=256, batch=2, tokenizer_dir="/t", data_dir="/x"
    )
    learned = harness.build_peer_command(**common, extra=[], model="qwen3_moe")
    balanced = harness.build_peer_command(**common, extra=["--y"], model="qwen3_moe", routing="balanced")
    assert learned[learned.index("--config") + 1] == "qwen3_moe_debug_sdpa"
    assert "--debug.moe-force-load-balance" not in learned
    assert balanced[-2:] == ["--debug.moe-force-load-balance", "--y"]  # the user's arguments still come last
    llama = harness.build_peer_command(**common, extra=[])
    assert llama[llama.index("--config") + 1] == "llama3_debugmodel_sdpa"
    for bad in (dict(model="mixtral"), dict(model="llama3", routing="balanced"), dict(routing="random")):
        with pytest.raises(ValueError):
            harness.build_peer_command(**common, extra=[], **bad)
    shim = _load("torchtitan_cpu_shim_names", ROOT / "scripts" / "bench" / "peer" / "torchtitan_cpu_shim.py")
    assert all(callable(getattr(shim, name)) for name in harness.PEER_CONFIGS.values())


@pytest.mark.parametrize(
    "preset, routing, ours",
    [("moe_ttshape", "learned", []), ("moe_ttshape_balanced", "balanced", ["--moe.routing=balanced"])],
)
def test_moe_preset_commands(script, capsys, preset, routing, ours):
    """--preset moe_ttshape[_balanced]: ours on the MoE TT-shape recipe, then TorchTitan's MoE, same routing and shape."""
    assert script.main(["--preset", preset, "--dry-run", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all("reference_torchtitan.py" in line for line in lines[1::2])  # interleaved
    assert all("configs/qwen3_moe_debug_ttshape.toml" in line for line in lines[::2])
    for flag in ours:
        assert all(flag in line for line in lines[::2])
    assert all(("--moe.routing=balanced" in line) == (routing == "balanced") for line in lines[::2])
    assert all(f"--seq-len 256 --batch 2 --model qwen3_moe --routing {routing}" in line for line in lines[1::2])


def test_moe_ttshape_recipe_is_torchtitans_qwen3_moe_debug():
    """configs/qwen3_moe_debug_ttshape.toml has TorchTitan 0.3.0's qwen3_moe_debug model.

    TorchTitan logs for it "Total parameter count: dense 13,637,888, sparse 302,120,960, ... active
    51,517,696" and "size: 315,758,848 total parameters": 8 layers of fused QKV 256 x (16+8+8) x 128,
    output 2048 x 256, q/k norms, 2 norms, a 64-expert router and 64 SwiGLU experts 256 x 768; untied
    2048 x 256 embedding and head. Exact counts, so any difference in a dimension fails it.
    """
    import torch

    from trainer.config import build_config, resolve_model_args

    cfg = build_config(str(ROOT / "configs" / "qwen3_moe_debug_ttshape.toml"), [])
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (256, 8, 16, 8, 128)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_hidden_dim, args.vocab_size) == (64, 8, 768, 2048)
    assert args.norm_topk_prob and args.moe_expert_bias and not args.tie_embeddings
    assert (args.rope_theta, cfg.training.aux_loss_coef, cfg.training.expert_bias_rate) == (1e6, 0.0, 1e-3)
    assert (cfg.activation_checkpoint.mode, cfg.training.mixed_precision_param) == ("selective", "bfloat16")
    assert (cfg.training.seq_len, cfg.training.local_batch_size) == (256, 2)  # the preset's shape, both sides
    with torch.device("meta"):
        model = family.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == 315_758_848
    assert args.num_active_params() == 51_517_696
