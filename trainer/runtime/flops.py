"""Model FLOPs per token and peak FLOP/s per device: the two halves of MFU.

MFU = achieved model FLOP/s per device / peak dense bf16 FLOP/s per device.

* `flops_per_token` counts training FLOPs (forward + backward) per token from the model's
  shape: 6·N for the matmul parameters plus the attention score/value matmuls, in two
  conventions (PaLM/TorchTitan counts the full T×T matrix, MaxText halves it for causal masks).
  Recompute from activation checkpointing is not counted (that is hardware, not model, FLOPs).
* `peak_flops_per_device` looks the accelerator up in a table of published dense bf16 peaks
  (per device: a TPU v7x chip is two devices) or, on the CPU, reads the matmul probe of
  `trainer.runtime.device.cpu_matmul_peaks` (measured once per machine and thread count, cached on disk)
  in the run's compute dtype, so CPU MFU means "fraction of what this core count can do on a
  big GEMM in this dtype"; `best_peak_flops` is the faster dtype's peak, shown beside it.
  An accelerator that is not in the table gets `None`, never a guessed peak.
"""

from __future__ import annotations

import logging
import os

import torch

from titan_kernels.tpu.tiles import generation_of
from trainer.runtime.pci import tpu_generations_on_pci

logger = logging.getLogger(__name__)


def flops_per_token(
    *, num_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 × forward).

    num_matmul_params: N, the parameters that take part in a matmul for one token: every
        Linear including the output projection, not the input embedding (a lookup), not norms;
        for MoE only the experts a token is routed to (plus the router and shared experts).
    n_heads, head_dim: query heads and their dim (GQA shares K/V but the score and value matmuls
        still run once per query head).

    Returns {"palm": 6N + 12·L·H·Q·T, "causal": 6N + 6·L·H·Q·T}. Per token, the forward score
    matmul QKᵀ and the value matmul each cost 2·H·Q·T FLOPs per layer (T keys), so the forward
    attention is 4·L·H·Q·T and training 12·L·H·Q·T; a causal mask makes half of it redundant.
    """
    assert min(num_matmul_params, n_layers, n_heads, head_dim, seq_len) > 0
    dense = 6.0 * num_matmul_params
    attention = float(n_layers * n_heads * head_dim * seq_len)
    return {"palm": dense + 12.0 * attention, "causal": dense + 6.0 * attention}


def model_flops_per_token(args, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of a model (its args), {"palm", "causal"}: the one count the
    trainer's MFU, the planner and the TPU projections read.

    - Matmul parameters: `args.num_active_params(exclude_embedding=True)`; with multi-token
      prediction (`mtp_depth` D > 0, DeepSeek-V3) the MTP modules are in that count and each depth
      runs the shared output head again (D x vocab x dim more).
    - Token mixing: a family whose blocks differ says so with `args.mixing_flops_per_token(seq_len)`
      (training FLOPs of all blocks' attention score/value products or recurrences, both
      conventions: gpt-oss's sliding-window blocks, Qwen 3.5's Gated DeltaNet blocks, and the
      family's MTP blocks); otherwise
      every block (and every MTP block) is full attention: 12 / 6 x L x H x Q x T
      (`flops_per_token`)."""
    shape = args.shape()
    mtp = getattr(args, "mtp_depth", 0)
    matmul = args.num_active_params(exclude_embedding=True) + mtp * shape.vocab_size * shape.dim
    mixing = getattr(args, "mixing_flops_per_token", None)
    if mixing is None:
        return flops_per_token(
            num_matmul_params=matmul,
            n_layers=shape.n_layers + mtp,
            n_heads=shape.n_heads,
            head_dim=shape.head_dim,
            seq_len=seq_len,
        )
    terms = mixing(seq_len)
    return {convention: 6.0 * matmul + terms[convention] for convention in ("palm", "causal")}


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s per device.

# Dense bf16 TFLOP/s per *device* (what one training process drives), from the vendors' published
# specifications (the table in docs/metrics.md, "Peak FLOP/s"). TPU v7x (Ironwood) is 2,307 per
# chip, exposed as two devices. v4 and v5p chips have two TensorCores but run as one "megacore"
# device.
TPU_PEAK_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0, "v7x": 2307.0 / 2}

# Matched in order against the lower-cased CUDA device name, so the more specific names
# ("gb200" before "b200", "h100 pcie" before "h100") come first. SXM parts unless named.
GPU_PEAK_TFLOPS = [
    ("gb300", 2500.0),
    ("gb200", 2500.0),
    ("b300", 2250.0),
    ("b200", 2250.0),
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),
    ("a100", 312.0),
]


def tpu_generation(kind: str) -> str | None:
    """Map any TPU kind string to a key of TPU_PEAK_TFLOPS, or None.

    Accepts JAX/PJRT device kinds ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v5p", "TPU v6 lite",
    "TPU7x"), accelerator types ("v5litepod-16", "v5p-128", "v6e-8", "tpu7x-64") and our short
    names ("v6e", "v7x"). A bare "TPU v5" is v5p (v5e always says "lite" or "e"). One mapping
    for the whole product: the kernels' tile table reads the same (`titan_kernels.tpu.tiles`).
    """
    return generation_of(kind)


def _tpu_kind_candidates() -> list[str]:
    """Strings that may name the local TPU generation, best first; never imports torch_tpu."""
    found = []
    tpu_module = getattr(torch, "tpu", None)  # installed by torch-tpu's autoload, if any
    if tpu_module is not None:
        for getter in ("get_device_name", "get_device_properties"):
            try:
                value = getattr(tpu_module, getter)()
            except Exception:  # internal-only or no device: fall through to the next source
                continue
            found.append(str(getattr(value, "name", value)))
    # GKE sets TPU_ACCELERATOR_TYPE; TPU VM images set ACCELERATOR_TYPE in the launch env.
    for var in ("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE"):
        if os.environ.get(var):
            found.append(os.environ[var])
    found.extend(tpu_generations_on_pci())
    return found


def _gpu_peak(name: str) -> float | None:
    lowered = name.lower()
    for key, tflops in GPU_PEAK_TFLOPS:
        if key in lowered:
            return tflops * 1e12
    return None


def peak_flops_per_device(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, *, override: float | str | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, a one-line description of where it came from).

    override: a number is the peak in TFLOP/s; a string names the device kind ("v6e", "TPU7x",
        "H100 PCIe") when detection cannot. The accelerator peak is the dense bf16 one whatever
        `dtype` is (the MFU convention); on the CPU `dtype` picks the probe's matmul dtype (the
        run's compute dtype) and the description names the other dtype's peak when it is higher.
    Returns (None, reason) for an accelerator that is not in the table, so MFU is reported as
    null instead of against a wrong peak.
    """
    if isinstance(override, (int, float)) and not isinstance(override, bool):
        assert override > 0, override
        return float(override) * 1e12, f"{override:g} TFLOP/s per device (override)"
    kind = override if isinstance(override, str) and override else None

    if device.type == "tpu" or (kind and tpu_generation(kind)):
        candidates = [kind] if kind else _tpu_kind_candidates()
        for candidate in candidates:
            gen = tpu_generation(candidate)
            if gen is not None:
                tflops = TPU_PEAK_TFLOPS[gen]
                return tflops * 1e12, f"TPU {gen}: {tflops:g} TFLOP/s dense bf16 per device (table; from {candidate!r})"
        return None, f"TPU generation unknown (saw {candidates}); MFU not reported, pass a peak override"

    if device.type == "cuda" or kind:
        name = kind or torch.cuda.get_device_name(device)
        peak = _gpu_peak(name)
        if peak is None:
            return None, f"GPU {name!r} is not in the peak table; MFU not reported, pass a peak override"
        return peak, f"{name}: {peak / 1e12:g} TFLOP/s dense bf16 per device (table)"

    if device.type == "cpu":
        from trainer.runtime.device import PROBE_SIZE, cpu_matmul_peaks

        peaks = cpu_matmul_peaks()
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        best = max(peaks, key=peaks.get)
        threads = torch.get_num_threads()
        desc = f"cpu: {peaks[name] / 1e9:.1f} GFLOP/s {name} matmul measured ({PROBE_SIZE}³, {threads} thread(s))"
        if best != name:  # a slow dtype must not look efficient: name the faster one's peak too
            desc += f"; {best} would peak at {peaks[best] / 1e9:.1f}"
        return peaks[name], desc

    return None, f"no peak known for device type {device.type!r}; MFU not reported"


def best_peak_flops(device: torch.device, peak: float | None) -> float | None:
    """The highest peak of any compute dtype on `device`: on the CPU the faster probe dtype's
    (trainer.runtime.device.cpu_matmul_peaks); on accelerators `peak` itself (the table is dense bf16)."""
    if device.type == "cpu" and peak is not None:
        from trainer.runtime.device import cpu_matmul_peaks

        return max(cpu_matmul_peaks().values())
    return peak
