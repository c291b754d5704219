"""Time TorchTitan's own Llama 3 debug model train step on this machine, as a reference for ours.

TorchTitan 0.3 cannot train on the CPU (its language models need FlexAttention, which has no CPU
backward in torch 2.13, or varlen attention, which is CUDA only), so this runs TorchTitan 0.2.2,
the last release whose debug model uses SDPA. It builds TorchTitan's `Transformer` from
`llama3_args["debugmodel"]` (dim 256, 6 layers, 16 heads, no GQA, vocab 2048) and runs the
step of its single-device trainer: `torch.autocast(bf16)` (TorchTitan's `maybe_enable_amp` for
one device), cross entropy on fp32 logits, `clip_grad_norm_(foreach=True)`, fused AdamW. Data
are random tokens: the data loader is not part of the step.

Needs a separate venv (TorchTitan pins its own dependencies; its MoE module imports triton):

    python3 -m venv /tmp/ttv && /tmp/ttv/bin/pip install torch==2.13.0 torchtitan==0.2.2 triton
    OMP_NUM_THREADS=2 /tmp/ttv/bin/python scripts/reference_torchtitan.py --out tt_ref.csv

Prints one row (median over the steps after --warmup) and writes it as CSV.
"""

import argparse
import csv
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="CSV file to write")
    args = parser.parse_args()

    import torchtitan
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model_args = llama3_args["debugmodel"]
    model_args.max_seq_len = args.seq_len
    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, eps=1e-8, weight_decay=0.1, fused=True)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return loss.item()

    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        print(f"step {i + 1}: loss {loss:.4f}  {args.batch * args.seq_len / times[-1]:,.0f} tok/s", flush=True)
    median_s = statistics.median(times[args.warmup:])
    row = {
        "impl": f"torchtitan {torchtitan.__version__ if hasattr(torchtitan, '__version__') else '0.2.x'}",
        "params": n_params, "seq_len": args.seq_len, "batch": args.batch, "threads": torch.get_num_threads(),
        "step_s": round(median_s, 4), "tok_s": round(args.batch * args.seq_len / median_s, 1),
        "tok_s_min": round(args.batch * args.seq_len / max(times[args.warmup:]), 1),
        "tok_s_max": round(args.batch * args.seq_len / min(times[args.warmup:]), 1),
    }
    print(" | ".join(f"{k} {v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            writer.writeheader()
            writer.writerow(row)


if __name__ == "__main__":
    main()
