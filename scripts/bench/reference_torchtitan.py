"""The peer harness: run TorchTitan 0.3.0's own trainer on its llama3 or Qwen 3 MoE debug model, report it like ours.

Runs in the peer venv (`bash scripts/bench/peer_env.sh` builds `.venv-peer/`), not in ours:

    OMP_NUM_THREADS=2 .venv-peer/bin/python scripts/bench/reference_torchtitan.py \
        --dump-folder outputs/peer/tt --steps 20 --warmup 5 --out tt.csv

What it runs is `torchtitan.train.main` (TorchTitan's entry point, config system and `Trainer`) on its
`llama3_debugmodel` config (dim 256, 6 layers, 16 heads, 16 kv heads, FFN 768, vocab 2048, fused
QKV, SelectiveAC, AdamW lr 8e-4, bf16 mixed precision; seq 2048, batch 8), launched with torchrun as
TorchTitan's run_train.sh does, through scripts/bench/peer/torchtitan_cpu_shim.py (what the CPU and torch
2.13.0 need: its device helpers, its SDPA attention module, torch's timeout name and the pipeline
schedules' pre-split micro-batches; the shim's docstring says why). Per run:

1. Assets: TorchTitan's debug config reads a Hugging Face tokenizer and the `c4_test` JSON dataset
   from its source tree, which the wheel does not ship. We give it our bundled corpus
   (assets/corpus, written once as JSON lines under --assets) and assets/tokenizer/bpe_2k, a
   byte-level BPE with exactly 2,048 tokens (the debug model's embedding rows) trained on that
   corpus by `--make-tokenizer`. Our side at TorchTitan's shape (configs/llama3_debug_ttshape.toml)
   reads the same tokenizer, so both sides see the same token stream.
2. The run itself, with checkpoints, validation, profiling and TensorBoard off, a log line every
   step and colours off; its stdout goes to <dump-folder>/stdout.log.
3. TorchTitan's per-step log line (`step: N  loss: ...  tps: T  tflops: F  mfu: M%`) is parsed into
   <dump-folder>/metrics.jsonl in our trainer's schema (step, loss, tokens_per_sec per device,
   tflops), so scripts/benchmark.py summarizes the peer with exactly the code that summarizes ours.
   TorchTitan's `tps` is its own per-device tokens/s over the whole step (data loading included).
   Its MFU is dropped on the CPU: it divides by an A100's peak when it does not know the device.

`--model qwen3_moe` runs TorchTitan's own MoE trainer instead: its `qwen3_moe_debug` config (Qwen 3
debugmodel_moe: dim 256, 8 layers, 16 heads of 128, 8 kv heads, 64 experts of width 768, top-8,
softmax router with renormalized top-k weights, auxiliary-loss-free expert bias, vocab 2048;
315,758,848 parameters; SelectiveAC, AdamW lr 3e-4, bf16 mixed precision through its FSDP wrapper
even on one process) with the same SDPA swap (the shim's `qwen3_moe_debug_sdpa`); our side is
configs/qwen3_moe_debug_ttshape.toml. `--routing balanced` turns on TorchTitan's
`--debug.moe-force-load-balance` (token t's j-th expert is (t*k + j) mod E, the same round-robin as
our `[moe] routing = "balanced"`).

Arguments after `--` go to TorchTitan's command line (its tyro syntax: `--training.dtype float32`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from trainer.runtime import cli  # noqa: E402  (standard library only: runs in the peer venv)

SHIM = REPO / "scripts" / "bench" / "peer" / "torchtitan_cpu_shim.py"
PEER_MODULE = "scripts.bench.peer.torchtitan_cpu_shim"
# --model: TorchTitan's config, through the shim (its SDPA swap). Both have vocab_size=2048.
PEER_CONFIGS = {"llama3": "llama3_debugmodel_sdpa", "qwen3_moe": "qwen3_moe_debug_sdpa"}
PEER_CONFIG = PEER_CONFIGS["llama3"]
PEER_VOCAB = 2048  # TorchTitan 0.3.0 llama3 `_debugmodel` and qwen3 `_debugmodel_moe`: vocab_size=2048
# --routing: TorchTitan's router as is (learned top-k) or its `debug.moe_force_load_balance` round-robin.
ROUTING_ARGS = {"learned": [], "balanced": ["--debug.moe-force-load-balance"]}
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")
TOKENIZER = REPO / "assets" / "tokenizer" / "bpe_2k"  # shared by both sides: see make_tokenizer

# TorchTitan's metrics line; colour codes are off (--metrics.disable-color-printing) but stripped anyway.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.eE]+|nan|inf)\s+grad_norm:\s*(?P<grad_norm>[-+\d.eE]+|nan|inf)"
    r".*?tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)"
)


# ------------------------------------------------------------------------------ pure helpers


def build_peer_command(
    *,
    python: str,
    nproc: int,
    dump_folder: str,
    steps: int,
    seq_len: int,
    batch: int,
    tokenizer_dir: str,
    data_dir: str,
    extra: list[str],
    model: str = "llama3",
    routing: str = "learned",
) -> list[str]:
    """TorchTitan's launch, as run_train.sh does it (torchrun even for one process: it reads LOCAL_RANK)."""
    if model not in PEER_CONFIGS:
        raise ValueError(f"model {model!r}; allowed: {', '.join(PEER_CONFIGS)}")
    if routing not in ROUTING_ARGS or (routing != "learned" and model == "llama3"):
        raise ValueError(f"routing {routing!r} for {model}; allowed: learned, or balanced for an MoE model")
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--local-ranks-filter=0",
        str(SHIM),
        "--module",
        PEER_MODULE,
        "--config",
        PEER_CONFIGS[model],
        "--hf-assets-path",
        tokenizer_dir,
        "--dataloader.dataset-path",
        data_dir,
        "--dump-folder",
        dump_folder,
        "--training.steps",
        str(steps),
        "--training.seq-len",
        str(seq_len),
        "--training.local-batch-size",
        str(batch),
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--profiler.no-enable-profiling",
        "--metrics.no-enable-tensorboard",
        "--metrics.log-freq",
        "1",
        "--metrics.disable-color-printing",
        *ROUTING_ARGS[routing],
        *extra,
    ]


def parse_torchtitan_log(text: str, *, keep_mfu: bool) -> list[dict]:
    """TorchTitan's per-step metric lines -> our metrics.jsonl records (last record per step wins)."""
    by_step: dict[int, dict] = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(_ANSI.sub("", line))
        if match is None:
            continue
        mfu = match["mfu"]
        by_step[int(match["step"])] = {
            "step": int(match["step"]),
            "loss": float(match["loss"]),
            "grad_norm": float(match["grad_norm"]),
            "tokens_per_sec": float(match["tps"].replace(",", "")),
            "tflops": float(match["tflops"].replace(",", "")),
            "mfu_pct": float(mfu[:-1]) if keep_mfu and mfu != "N/A" else None,
        }
    return [by_step[s] for s in sorted(by_step)]


# ------------------------------------------------------------------------------ assets


def prepare_data(root: Path, corpus: Path) -> Path:
    """Our bundled corpus as the JSON-lines dataset TorchTitan's `c4_test` loader reads (made once)."""
    data_dir = root / "data"
    if not (data_dir / "train.jsonl").is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(corpus, "rt") as src, open(data_dir / "train.jsonl.tmp", "w") as dst:
            for line in src:
                if line.strip():
                    dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
        os.replace(data_dir / "train.jsonl.tmp", data_dir / "train.jsonl")
    return data_dir


def make_tokenizer(out_dir: Path, corpus: Path) -> None:
    """How assets/tokenizer/bpe_2k/ was made: a 2,048-token byte-level BPE on the bundled corpus.

    Llama 3's split regex then byte-level BPE (the layout our trainer/data/tokenizer.py reads as tiktoken
    ranks), `<|begin_of_text|>` and `<|end_of_text|>` as added tokens, and a tokenizer_config.json
    naming them, which TorchTitan's HuggingFaceTokenizer needs for BOS/EOS.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    sys.path.insert(0, str(REPO))
    from trainer.data.tokenizer import LLAMA3_PATTERN

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=PEER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with gzip.open(corpus, "rt") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert tokenizer.get_vocab_size() == PEER_VOCAB, tokenizer.get_vocab_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[1],
                "add_bos_token": True,
                "add_eos_token": True,
            },
            indent=1,
        )
        + "\n"
    )


def _load_benchmark():
    """scripts/benchmark.py's runner, tools/benchmark.py (stdlib only), for the summary logic shared
    with our side."""
    from tools import benchmark

    return benchmark


# ------------------------------------------------------------------------------ main


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our arguments, and those after `--` (TorchTitan's command line)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _parse_args(argv: list[str]):
    """Our command line; `--routing balanced` refused for the dense model."""
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump-folder", required=True, help="run folder: stdout.log, metrics.jsonl, TorchTitan's dump")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps dropped from the summary")
    parser.add_argument(
        "--model", default="llama3", choices=sorted(PEER_CONFIGS), help="TorchTitan's debug model (through the shim)"
    )
    parser.add_argument(
        "--routing",
        default="learned",
        choices=sorted(ROUTING_ARGS),
        help="MoE routing: TorchTitan's learned top-k, or balanced (its debug.moe_force_load_balance round-robin)",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes (data parallel, TorchTitan's FSDP)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="local batch size per process")
    parser.add_argument("--tokenizer", default=str(TOKENIZER), help="tokenizer.json directory (2,048 tokens)")
    parser.add_argument("--assets", default=str(REPO / "outputs" / "peer_assets"), help="dataset cache folder")
    parser.add_argument(
        "--make-tokenizer",
        metavar="DIR",
        default=None,
        help="train the 2,048-token BPE into DIR and exit (how --tokenizer's default was made)",
    )
    parser.add_argument("--corpus", default=str(REPO / "assets" / "corpus" / "train.jsonl.gz"))
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=None, help="summary CSV, in scripts/benchmark.py's row format")
    args = parser.parse_args(argv)
    if args.routing != "learned" and args.model == "llama3":
        parser.error(f"--routing: {args.routing} needs an MoE model; allowed with --model llama3: learned")
    return args


def _run_peer(args, extra: list[str]) -> tuple[Path, int]:
    """Assets, then TorchTitan's run with its stdout in <dump-folder>/stdout.log: (folder, exit code; 124 on timeout)."""
    tokenizer_dir, data_dir = (
        Path(args.tokenizer).resolve(),
        prepare_data(Path(args.assets), Path(args.corpus)).resolve(),
    )
    folder = Path(args.dump_folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cmd = build_peer_command(
        python=sys.executable,
        nproc=args.nproc,
        dump_folder=str(folder / "torchtitan"),
        steps=args.steps,
        seq_len=args.seq_len,
        batch=args.batch,
        tokenizer_dir=str(tokenizer_dir),
        data_dir=str(data_dir),
        extra=extra,
        model=args.model,
        routing=args.routing,
    )
    with open(folder / "stdout.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return folder, rc


def _write_metrics(folder: Path, *, keep_mfu: bool) -> list[dict]:
    """TorchTitan's step lines from stdout.log into <folder>/metrics.jsonl, in our trainer's schema."""
    records = parse_torchtitan_log((folder / "stdout.log").read_text(), keep_mfu=keep_mfu)
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records


def _report(args, rc: int, records: list[dict]) -> None:
    """The run's summary row (scripts/benchmark.py's format) on stdout, and as CSV with `--out`."""
    bench = _load_benchmark()
    row = {
        "variant": "torchtitan",
        "nproc": args.nproc,
        "repeat": 0,
        "rc": rc,
        **bench.summarize_run(records, args.warmup),
        **bench.machine_fields(),
    }
    print(" | ".join(f"{k} {v}" for k, v in row.items()))
    if args.out:
        bench.write_csv(Path(args.out), [row])


def main(argv: list[str] | None = None) -> int:
    argv, extra = _split_passthrough(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)

    import torch

    if args.make_tokenizer:
        make_tokenizer(Path(args.make_tokenizer), Path(args.corpus))
        return 0
    folder, rc = _run_peer(args, extra)
    records = _write_metrics(folder, keep_mfu=torch.cuda.is_available())
    if rc != 0:
        cli.error_line(f"TorchTitan exited {rc}; see {folder / 'stdout.log'}")
        return 1
    if not records:
        cli.error_line(f"no TorchTitan step lines in {folder / 'stdout.log'}")
        return 1
    _report(args, rc, records)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
