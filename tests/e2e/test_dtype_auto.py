"""`[training] mixed_precision_param = "auto"`: the CPU matmul probe, its cache, the choice, the
ranks' agreement, the attention line and the MFU peak that follow from it (trainer/runtime/device.py,
trainer/runtime/flops.py, titan_kernels.select). The probe's timings are mocked except in one test that
measures for real, so the choice tested never depends on this machine's CPU."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import titan_kernels
from models.errors import ConfigError
from titan_kernels import cpu_attention
from trainer.config import build_config
from trainer.runtime import device as dev
from trainer.runtime import flops

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_probe(tmp_path, monkeypatch):
    """Each test: its own probe cache file and an empty in-process cache."""
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "cache"))
    dev._PROBES.clear()
    yield
    dev._PROBES.clear()


def fake_probe(monkeypatch, tflops: dict[str, float]) -> list[str]:
    """Replace the timed matmul by fixed TFLOP/s per dtype; returns the list of dtypes measured."""
    calls = []

    def measure(dtype, **_):
        name = str(dtype).removeprefix("torch.")
        calls.append(name)
        return tflops[name], 1.0  # an idle machine: the whole CPU share

    monkeypatch.setattr(dev, "measure_matmul", measure)
    return calls


@pytest.mark.parametrize(
    "tflops, want",
    [
        ({"bfloat16": 0.175, "float32": 0.340}, "float32"),  # Xeon with AVX512-BF16, no AMX
        ({"bfloat16": 1.500, "float32": 0.330}, "bfloat16"),  # EPYC / AMX: bf16 several times faster
    ],
)
def test_auto_picks_the_faster_dtype(monkeypatch, tflops, want):
    calls = fake_probe(monkeypatch, tflops)
    got = dev.resolve_compute_dtype("auto", CPU)
    assert got.name == want and got.dtype == dev.PROBE_DTYPES[want]
    assert sorted(calls) == ["bfloat16", "float32"]
    # the banner line names both rates (GFLOP/s) and the cache
    assert f"{tflops[want] * 1e3:.0f} GFLOP/s" in got.reason and str(dev.probe_cache_path()) in got.reason


def test_probe_is_cached_on_disk_and_keyed(monkeypatch):
    calls = fake_probe(monkeypatch, {"bfloat16": 0.2, "float32": 0.3})
    first = dev.cpu_matmul_peaks()
    assert len(calls) == 2
    dev._PROBES.clear()  # a new process: only the file remains
    assert dev.cpu_matmul_peaks() == first and len(calls) == 2  # read back, not measured again
    data = json.loads(dev.probe_cache_path().read_text())
    assert list(data) == [dev.probe_cache_key()]
    assert data[dev.probe_cache_key()]["float32"] == pytest.approx(0.3e12)
    # the key carries what the rate depends on
    assert dev.probe_cache_key(1) != dev.probe_cache_key(2)
    assert torch.__version__ in dev.probe_cache_key() and dev.cpu_model() in dev.probe_cache_key()
    # another thread count (another key) and a damaged file are measured again
    dev._PROBES.clear()
    monkeypatch.setattr(dev, "probe_cache_key", lambda threads=None: "other CPU | torch x | 3 thread(s)")
    dev.cpu_matmul_peaks()
    assert len(calls) == 4 and len(json.loads(dev.probe_cache_path().read_text())) == 2
    dev._PROBES.clear()
    dev.probe_cache_path().write_text('{"cut short')
    dev.cpu_matmul_peaks()
    assert len(calls) == 6


def test_a_probe_on_a_busy_machine_is_cached_so_the_choice_is_made_once(monkeypatch, capsys):
    """The best timed run's CPU share (process CPU time / (wall x threads)) below BUSY_SHARE means
    other jobs shared the cores. Measured again on every start-up, a loaded machine picked bf16 one
    run and fp32 the next; so the first probe is cached all the same, marked, and every later run
    reads it: one choice, and one start-up line saying it was measured under load and how to redo it."""
    load = iter([(0.30, 1.0), (0.20, 0.45)])  # bf16 faster, fp32 measured while another job ran

    def measure(dtype, **_):
        return next(load)

    monkeypatch.setattr(dev, "measure_matmul", measure)
    first = dev.resolve_compute_dtype("auto", CPU)
    assert first.name == "bfloat16"
    entry = json.loads(dev.probe_cache_path().read_text())[dev.probe_cache_key()]
    assert entry["cpu_share"] == pytest.approx(0.45)
    assert capsys.readouterr().out == ""  # nothing printed beside the banner's one line
    assert "\n" not in first.reason and "measured now under load (this process had 45%" in first.reason
    assert f"cached in {dev.probe_cache_path()}; delete it to measure again" in first.reason
    assert "not cached" not in first.reason

    def busy_again(dtype, **_):  # the next start-up would now time fp32 faster
        raise AssertionError("measured again")

    monkeypatch.setattr(dev, "measure_matmul", busy_again)
    for _ in range(3):  # later processes read the choice back: it never flips
        dev._PROBES.clear()
        again = dev.resolve_compute_dtype("auto", CPU)
        assert again.name == "bfloat16" and "under load" in again.reason and "measured now" not in again.reason
        assert f"measured {entry['measured_at']}" in again.reason and "delete it to measure again" in again.reason


def test_a_probe_that_cannot_be_cached_says_so_in_its_one_line(monkeypatch):
    fake_probe(monkeypatch, {"bfloat16": 0.2, "float32": 0.3})
    blocker = dev.probe_cache_path().parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the cache folder should be")
    got = dev.resolve_compute_dtype("auto", CPU)
    assert got.name == "float32" and "\n" not in got.reason
    assert "measured now, not cached" in got.reason and "cached in" not in got.reason


def test_the_probe_measures_its_cpu_share():
    """A real timed matmul records a share in (0, ~1]: this process's CPU time cannot exceed wall x
    its threads, but for the per-thread clocks' nanosecond granularity and the BLAS pool's
    helper threads spinning at a barrier (hence 1.2, not 1)."""
    tflops, share = dev.measure_matmul(torch.float32, size=512, repeats=2)
    assert tflops > 0 and 0 < share <= 1.2


def test_a_slowly_emulated_dtype_is_timed_at_a_smaller_size(monkeypatch):
    """A dtype at ~1 GFLOP/s (no instructions for it) would take ~17 s per 2048³ product: the
    256³ pilot's rate picks the largest size whose product fits the budget (512³: 0.27 s); fp32
    (every CPU has FMA units for it) keeps 2048³."""
    real_mm = torch.mm

    def slow_mm(a, b):
        if a.dtype != torch.bfloat16:
            return real_mm(a, b)
        # only the sleep: a real bf16 product would add this CPU's own bf16 time to the fake's
        time.sleep(2.0 * a.shape[0] * a.shape[1] * b.shape[1] / 1e9)
        return a.new_empty(a.shape[0], b.shape[1])

    monkeypatch.setattr(torch, "mm", slow_mm)
    assert dev.probe_size(torch.bfloat16) == 512
    assert dev.probe_size(torch.float32) == dev.PROBE_SIZE


def test_explicit_dtypes_and_accelerators_never_probe(monkeypatch):
    def measure(*_, **__):
        raise AssertionError("the probe ran")

    monkeypatch.setattr(dev, "measure_matmul", measure)
    assert dev.resolve_compute_dtype("float32", CPU).name == "float32"
    assert dev.resolve_compute_dtype("bfloat16", CPU).name == "bfloat16"
    for device in (torch.device("cuda", 0), SimpleNamespace(type="tpu")):  # no torch-tpu needed
        got = dev.resolve_compute_dtype("auto", device)
        assert got.name == "bfloat16" and "auto: bfloat16 on" in got.reason


def test_bad_value_is_one_error_line(tmp_path, capsys):
    from trainer.train import main

    with pytest.raises(
        ConfigError,
        match=r"training.mixed_precision_param: 'fp16' is not allowed; "
        r"allowed: bfloat16, float32, auto",
    ):
        build_config("configs/llama3_debug.toml", [("training.mixed_precision_param", "fp16")])
    rc = main(
        [
            "--config",
            "configs/llama3_debug.toml",
            "--training.mixed_precision_param=fp16",
            f"--job.dump_folder={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: training.mixed_precision_param"), err


def test_shipped_cpu_recipes_say_auto():
    for name in ("llama3_debug", "qwen3_debug", "qwen3_moe_debug", "flux_debug"):
        assert build_config(f"configs/{name}.toml", []).training.mixed_precision_param == "auto", name


def test_mfu_peak_is_the_chosen_dtypes(monkeypatch):
    """MFU divides by the peak of the dtype the run computes in; the description and
    `best_peak_flops` name the faster dtype's peak, so a slow choice cannot look efficient."""
    fake_probe(monkeypatch, {"bfloat16": 0.4, "float32": 0.1})
    peak, desc = flops.peak_flops_per_device(CPU, torch.float32)
    assert peak == pytest.approx(0.1e12)
    assert "100.0 GFLOP/s float32" in desc and "bfloat16 would peak at 400.0" in desc
    assert flops.best_peak_flops(CPU, peak) == pytest.approx(0.4e12)
    peak, desc = flops.peak_flops_per_device(CPU, torch.bfloat16)
    assert peak == pytest.approx(0.4e12) and "would peak" not in desc
    # accelerators: the table's bf16 peak is the best one
    assert flops.best_peak_flops(torch.device("meta"), 918e12) == 918e12


def test_real_probe_is_plausible_and_cached(monkeypatch):
    """One real measurement of both dtypes (~1-2 s): a rate between one slow core and a few
    hundred fast ones, then served from the in-process and the on-disk cache. The busy-machine
    rule is off here (a probe on a loaded machine is not cached, and CI's machine may be
    loaded; that rule has its own test above)."""
    monkeypatch.setattr(dev, "BUSY_SHARE", 0.0)
    peaks = dev.cpu_matmul_peaks()
    assert set(peaks) == {"bfloat16", "float32"}
    # 1e7: one core emulating a dtype it has no instructions for (bf16 on an AVX2-only EPYC:
    # 1.3e9 at the probe's 512³, 1.5e8 at 2048³); 1e15: hundreds of AMX cores
    assert all(1e7 < v < 1e15 for v in peaks.values()), peaks
    dev._PROBES.clear()
    assert dev.cpu_matmul_peaks() == pytest.approx(peaks)


def test_attention_line_follows_the_dtype(monkeypatch):
    """The CPU kernel serves bf16 only with AVX512-BF16 and fp32 only up to head_dim 32; the
    start-up line says which backend this run's (dtype, head_dim) takes."""
    monkeypatch.setitem(cpu_attention._state, "ok", True)
    monkeypatch.setattr(cpu_attention, "load", lambda: True)
    monkeypatch.setattr(cpu_attention, "ops", lambda: [])
    monkeypatch.setattr(cpu_attention, "_ISA", ("avx512", "flags", 16, False))  # AVX-512 without BF16
    assert cpu_attention.applies(torch.float32, 16) and cpu_attention.applies(torch.float32, 32)
    assert not cpu_attention.applies(torch.float32, 64) and not cpu_attention.applies(torch.bfloat16, 16)
    line = titan_kernels.select(attention="auto", device=CPU, dtype=torch.float32, head_dim=16)
    assert line == "auto (cpu kernel for float32 at head_dim 16)"
    line = titan_kernels.select(attention="auto", device=CPU, dtype=torch.bfloat16, head_dim=16)
    assert line.startswith("auto (sdpa") and "bfloat16" in line
    monkeypatch.setattr(cpu_attention, "_ISA", ("avx512_bf16", "flags", 16, True))
    monkeypatch.setitem(cpu_attention._state, "amx", False)  # AVX512-BF16 dot products: bf16 up to 128
    assert cpu_attention.applies(torch.bfloat16, 128) and not cpu_attention.applies(torch.float32, 128)
    monkeypatch.setitem(cpu_attention._state, "amx", True)  # AMX path: ATen's flash kernel wins at 128
    assert cpu_attention.applies(torch.bfloat16, 64) and not cpu_attention.applies(torch.bfloat16, 128)


def _rank_main(rank: int, world: int, init: str, cache_root: str, out: str) -> None:
    # Each rank would measure differently (rank 0: bf16 faster, rank 1: fp32 faster) and has
    # its own cache folder: only a broadcast from rank 0 makes them agree.
    os.environ["TITAN_CACHE"] = os.path.join(cache_root, f"rank{rank}")
    calls = []

    def measure(dtype, **_):
        calls.append(dtype)
        fast = torch.bfloat16 if rank == 0 else torch.float32
        return (1.0 if dtype == fast else 0.5), 1.0

    dev.measure_matmul = measure
    dist.init_process_group(dev.cpu_backend(), init_method=init, rank=rank, world_size=world)
    try:
        got = dev.resolve_compute_dtype("auto", CPU)
        peak, _ = flops.peak_flops_per_device(CPU, got.dtype)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"name": got.name, "peak": peak, "measured": len(calls)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ranks_agree(tmp_path):
    """Two gloo ranks: rank 0 measures, rank 1 never does, both take rank 0's dtype and peak."""
    mp.spawn(_rank_main, args=(2, f"file://{tmp_path / 'pg'}", str(tmp_path / "caches"), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["name"] for g in got] == ["bfloat16", "bfloat16"]
    assert got[0]["peak"] == got[1]["peak"] == pytest.approx(1e12)
    assert [g["measured"] for g in got] == [2, 0]
    assert not (tmp_path / "caches" / "rank1").exists()


def test_thread_ranks_agree_and_measure_once(monkeypatch):
    """Thread ranks share one process cache: every rank still joins each broadcast (none skips
    it and leaves the others waiting), rank 0 measures once, all take its numbers."""
    from tests.support.parallel_harness import run_threads

    calls = fake_probe(monkeypatch, {"bfloat16": 0.2, "float32": 0.3})

    def rank():
        first = dev.resolve_compute_dtype("auto", CPU).name
        peak, _ = flops.peak_flops_per_device(CPU, dev.PROBE_DTYPES[first])
        return first, peak, flops.best_peak_flops(CPU, peak)

    assert run_threads(2, rank) == [("float32", pytest.approx(0.3e12), pytest.approx(0.3e12))] * 2
    assert len(calls) == 2
