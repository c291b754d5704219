"""Checkpointing: DCP round trip, resume equivalence, retention, atomicity, async, errors.

A small model with the real module paths (layers.N.attention.wq ...) stands in for Llama so the
tests run in seconds; the multi-process test shards it with DTensor the way SimpleFSDP does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from models.errors import ConfigError
from trainer import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(dim, dim, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.feed_forward.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.attention.wq(x)
        return x + self.feed_forward.w2(torch.relu(self.feed_forward.w1(x)))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 8, n_layers: int = 2, vocab: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class FakeLoader:
    """Deterministic batches from a position; state is a plain dict, like trainer/data/text.py."""

    def __init__(self):
        self.pos = 0

    def next_batch(self):
        gen = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        tokens = torch.randint(0, 16, (2, 6), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = int(state["pos"])


class Run:
    """Everything a trainer checkpoints, built fresh from a seed."""

    def __init__(self, seed: int = 0, dim: int = 8, n_layers: int = 2, **optimizer_kw):
        torch.manual_seed(seed)
        self.model = TinyLM(dim=dim, n_layers=n_layers)
        self.loader = FakeLoader()
        self.train_state = ckpt.TrainState()
        self.optimizer_kw = {"lr": 1e-2, **optimizer_kw}
        self.build_optimizer()

    def build_optimizer(self):
        """(Re)build optimizer and schedule, e.g. after the parameters were replaced by DTensors."""
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **self.optimizer_kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.states = {
            "model": ckpt.ModelState(self.model),
            "optimizer": ckpt.OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler,
            "dataloader": self.loader,
            "train_state": self.train_state,
        }

    def step(self) -> float:
        inputs, labels = self.loader.next_batch()
        logits = self.model(inputs)
        # Random noise (like dropout) makes the result depend on the restored RNG state.
        logits = logits + 0.1 * torch.randn_like(logits)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.train_state.step += 1
        return loss.item()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def manager(folder, **kw) -> ckpt.CheckpointManager:
    defaults = dict(interval=1, keep_latest_k=0, async_mode="disabled", enable=True)
    defaults.update(kw)
    return ckpt.CheckpointManager(folder=folder, **defaults)


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_resume_matches_uninterrupted_run(tmp_path):
    # Uninterrupted: 5 steps, with a checkpoint at step 3.
    ref = Run(seed=0)
    mgr = manager(tmp_path / "ckpt", interval=3)
    losses = []
    for step in range(1, 6):
        losses.append(ref.step())
        mgr.maybe_save(step, ref.states)
    mgr.close()
    assert mgr.complete_steps() == [3]

    # Resumed: a different seed and an RNG draw before load, so only the checkpoint can make it equal.
    resumed = Run(seed=123)
    torch.rand(7)
    mgr2 = manager(tmp_path / "ckpt", interval=3)
    assert mgr2.load(resumed.states) == 3
    assert resumed.train_state.step == 3 and resumed.loader.pos == 3
    assert resumed.scheduler.last_epoch == 3
    resumed_losses = [resumed.step(), resumed.step()]
    assert resumed_losses == losses[3:]
    assert_same(resumed.params(), ref.params())
    for group_ref, group_new in zip(ref.optimizer.param_groups, resumed.optimizer.param_groups):
        assert group_ref["lr"] == group_new["lr"]


def test_checkpoint_keys_are_the_contract(tmp_path):
    run = Run()
    run.step()
    mgr = manager(tmp_path)
    mgr.maybe_save(1, run.states)
    keys = set(dcp.FileSystemReader(str(tmp_path / "step-1")).read_metadata().state_dict_metadata)
    assert "model.layers.0.attention.wq.weight" in keys
    assert "model.tok_embeddings.weight" in keys
    assert "optimizer.state.layers.1.feed_forward.w2.weight.exp_avg" in keys
    assert "lr_scheduler.last_epoch" in keys
    assert "dataloader.pos" in keys
    assert "train_state.step" in keys and "train_state.rng.rank_0" in keys
    assert {k.split(".")[0] for k in keys} == set(ckpt.CHECKPOINT_KEYS)


def test_fresh_start_and_disabled(tmp_path):
    run = Run()
    assert manager(tmp_path / "none").load(run.states) == 0
    off = manager(tmp_path / "off", enable=False)
    assert off.maybe_save(1, run.states) is False
    assert not (tmp_path / "off").exists()
    assert off.load(run.states) == 0


def test_keep_latest_k_and_force(tmp_path):
    run = Run()
    mgr = manager(tmp_path, interval=2, keep_latest_k=2)
    for step in range(1, 8):
        run.step()
        mgr.maybe_save(step, run.states, force=step == 7)
    assert mgr.complete_steps() == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-7"]
    # A second forced save of the same step is a no-op.
    assert mgr.maybe_save(7, run.states, force=True) is False


def test_load_step_and_bad_inputs(tmp_path):
    run = Run()
    mgr = manager(tmp_path)
    snapshots = {}
    for step in range(1, 4):
        run.step()
        mgr.maybe_save(step, run.states)
        snapshots[step] = run.params()

    other = Run(seed=9)
    assert manager(tmp_path, load_step=2).load(other.states) == 2
    assert_same(other.params(), snapshots[2])

    with pytest.raises(ConfigError, match=r"checkpoint.load_step: .*step-7.*\[1, 2, 3\]"):
        manager(tmp_path, load_step=7).load(Run().states)

    # A checkpoint with a missing shard: named by load_step -> ConfigError, and nothing is touched.
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="checkpoint.load_step"):
        manager(tmp_path, load_step=2).load(Run().states)
    (tmp_path / "step-1" / ".metadata").unlink()  # no metadata: not a complete checkpoint
    with pytest.raises(ConfigError, match=r"step-1 is not a complete checkpoint"):
        manager(tmp_path, load_step=1).load(Run().states)
    before = [b for b in before if b[0] != Path("step-1/.metadata")]
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before

    # A checkpoint of another model (wider) does not fit: ConfigError, not a traceback.
    with pytest.raises(ConfigError, match="checkpoint.folder: .*step-3"):
        manager(tmp_path).load(Run(dim=12).states)

    for bad in (dict(async_mode="sometimes"), dict(keep_latest_k=-1), dict(load_step=-3), dict(interval=0)):
        with pytest.raises(ConfigError, match="checkpoint."):
            manager(tmp_path, **bad)


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    run = Run()
    mgr = manager(tmp_path)
    run.step()
    mgr.maybe_save(1, run.states)
    saved = run.params()
    run.step()

    def broken_write(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken_write)
    with pytest.raises(ckpt.CheckpointSaveError, match="disk full"):
        mgr.maybe_save(2, run.states)
    monkeypatch.undo()
    assert mgr.complete_steps() == [1]
    fresh = Run(seed=5)
    assert manager(tmp_path).load(fresh.states) == 1
    assert_same(fresh.params(), saved)
    # The next save removes the leftover and publishes normally.
    run.step()
    mgr.maybe_save(3, run.states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-3"]


CRASH_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import torch.distributed.checkpoint as dcp
    from tests.unit.test_checkpoint import Run, manager
    run = Run()
    mgr = manager({folder!r})
    run.step()
    mgr.maybe_save(1, run.states)
    run.step()
    # Die after the shards are written but before the metadata: a job killed mid-save.
    dcp.FileSystemWriter.finish = lambda self, metadata, results: os.kill(os.getpid(), signal.SIGKILL)
    mgr.maybe_save(2, run.states)
    """
)


def test_killed_mid_save_leaves_newest_loadable(tmp_path):
    folder = tmp_path / "ckpt"
    code = CRASH_CHILD.format(repo=str(REPO), folder=str(folder))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftover = folder / ".tmp-step-2"
    assert any(leftover.glob("*.distcp")) and not (leftover / ".metadata").exists()
    mgr = manager(folder)
    assert mgr.complete_steps() == [1]
    run = Run(seed=3)
    assert mgr.load(run.states) == 1
    run.step()
    mgr.maybe_save(2, run.states)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2"]


def test_async_save_snapshots_state_and_publishes(tmp_path):
    run = Run()
    run.step()
    mgr = manager(tmp_path, async_mode="async", interval=2)
    assert mgr.maybe_save(2, run.states)
    expected = run.params()
    with torch.no_grad():  # training continues while the write is in flight
        for p in run.model.parameters():
            p.add_(1.0)
    deadline = time.monotonic() + 60
    while not mgr.complete_steps() and time.monotonic() < deadline:
        mgr.maybe_save(3, run.states)  # not a save step: only polls the pending save
        time.sleep(0.01)
    assert mgr.complete_steps() == [2]
    assert mgr.maybe_save(4, run.states)
    mgr.close()
    assert mgr.complete_steps() == [2, 4]
    assert not list(tmp_path.glob(".tmp-*"))
    fresh = Run(seed=7)
    assert manager(tmp_path, load_step=2).load(fresh.states) == 2
    assert_same(fresh.params(), expected)


def test_resave_same_step_replaces_it(tmp_path):
    run = Run()
    mgr = manager(tmp_path)
    run.step()
    mgr.save(1, run.states)
    run.step()
    mgr.save(1, run.states)  # e.g. resumed from an older step and reached this one again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    fresh = Run(seed=4)
    manager(tmp_path).load(fresh.states)
    assert_same(fresh.params(), run.params())


# ------------------------------------------------------------------------------ initial weights


def test_load_initial_dcp_prefixed_and_bare(tmp_path):
    src = Run(seed=1)
    src.step()
    manager(tmp_path / "run").save(1, src.states)
    dst = Run(seed=2)
    ckpt.load_initial(dst.model, path=tmp_path / "run" / "step-1", fmt="dcp")
    assert_same(dst.params(), src.params())

    bare = tmp_path / "bare"
    dcp.save({k: v.clone() for k, v in src.model.state_dict().items()}, checkpoint_id=str(bare), no_dist=True)
    dst2 = Run(seed=3)
    ckpt.load_initial(dst2.model, path=bare, fmt="dcp")
    assert_same(dst2.params(), src.params())

    with pytest.raises(
        ConfigError,
        match=r"checkpoint.initial_load_path: .* entries of the model are not in it "
        r"\(first: layers.2.attention.wq.weight",
    ):
        ckpt.load_initial(TinyLM(n_layers=3), path=bare, fmt="dcp")


def hf_names(ours: str) -> str:
    return "model." + ours.replace("attention.wq", "self_attn.q_proj").replace("tok_embeddings", "embed_tokens")


def from_hf(hf_state_dict, args):
    inverse = {hf_names(k): k for k in args}
    return {inverse[k]: v for k, v in hf_state_dict.items()}


def test_load_initial_hf_safetensors(tmp_path):
    from safetensors.torch import save_file

    src = TinyLM()
    names = list(src.state_dict())
    hf = {hf_names(k): v.to(torch.bfloat16).contiguous() for k, v in src.state_dict().items()}
    first, second = dict(list(hf.items())[:3]), dict(list(hf.items())[3:])
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    dst = TinyLM()
    ckpt.load_initial(dst, path=tmp_path, fmt="hf", hf_adapter=from_hf, args=names)
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0)

    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: .*entries of the model are not in it"):
        ckpt.load_initial(TinyLM(n_layers=3), path=tmp_path, fmt="hf", hf_adapter=from_hf, args=names)
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: .*does not exist"):
        ckpt.load_initial(dst, path=tmp_path / "nope", fmt="hf", hf_adapter=from_hf, args=names)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: no safetensors"):
        ckpt.load_initial(dst, path=tmp_path / "empty", fmt="hf", hf_adapter=from_hf)
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: .*not a DCP checkpoint"):
        ckpt.load_initial(dst, path=tmp_path, fmt="dcp")
    with pytest.raises(ConfigError, match="checkpoint.initial_load_format"):
        ckpt.load_initial(dst, path=tmp_path, fmt="pt")


# ------------------------------------------------------------------------------ two ranks, DTensor


def _shard(model: nn.Module, mesh) -> None:
    """SimpleFSDP (parallelisms/simple_fsdp.py): parameters become DTensors sharded on dp_shard."""
    from parallelisms.simple_fsdp import data_parallel

    data_parallel(model, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())


def _two_rank_worker(rank: int, world: int, store: str, folder: str, out: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["OMP_NUM_THREADS"] = "1"
    from trainer.runtime.device import cpu_backend

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        run = Run(seed=0)
        _shard(run.model, mesh)
        run.build_optimizer()
        torch.manual_seed(100)  # same seed on both ranks, like trainer.runtime.device.set_seed
        for p in run.model.parameters():  # one optimizer step with known (replicated) grads
            p.grad = torch.ones_like(p) * 0.5
        run.optimizer.step()
        run.scheduler.step()
        run.train_state.step = 1
        run.loader.pos = 5
        mgr = ckpt.CheckpointManager(folder=folder, interval=1, keep_latest_k=0, async_mode="async", enable=True)
        mgr.maybe_save(1, run.states)
        mgr.close()
        assert mgr.complete_steps() == [1]
        full = {k: v.full_tensor() for k, v in run.model.state_dict().items()}
        exp_avg = {k: run.optimizer.state[p]["exp_avg"].full_tensor() for k, p in run.model.named_parameters()}
        # Reload on the same 2-rank mesh into a fresh sharded model.
        fresh = Run(seed=42)
        _shard(fresh.model, mesh)
        fresh.build_optimizer()
        sync = ckpt.CheckpointManager(folder=folder, interval=1, keep_latest_k=0, async_mode="disabled", enable=True)
        assert sync.load(fresh.states) == 1
        for k, v in fresh.model.state_dict().items():
            assert torch.equal(v.full_tensor(), full[k]), k
        for k, p in fresh.model.named_parameters():
            assert torch.equal(fresh.optimizer.state[p]["exp_avg"].full_tensor(), exp_avg[k]), k
        if rank == 0:
            torch.save({"model": full, "exp_avg": exp_avg}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_rank_sharded_save_loads_on_one_process(tmp_path):
    import torch.multiprocessing as mp

    folder, out = tmp_path / "ckpt", tmp_path / "expected.pt"
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "store"), str(folder), str(out)), nprocs=2, join=True)
    expected = torch.load(out)
    run = Run(seed=11)  # plain tensors, one process: a different "mesh" than the save
    assert manager(folder).load(run.states) == 1
    assert run.loader.pos == 5 and run.scheduler.last_epoch == 1
    assert_same(run.params(), expected["model"])
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(run.optimizer.state[p]["exp_avg"], expected["exp_avg"][name], rtol=0, atol=0)
    assert run.train_state.step == 1


def test_nested_scheduler_state_round_trips(tmp_path):
    # SequentialLR keeps its children's states as a list of dicts, which DCP flattens by index.
    def build(seed):
        run = Run(seed=seed)
        warm = torch.optim.lr_scheduler.LinearLR(run.optimizer, start_factor=0.1, total_iters=3)
        decay = torch.optim.lr_scheduler.ExponentialLR(run.optimizer, gamma=0.5)
        run.scheduler = torch.optim.lr_scheduler.SequentialLR(run.optimizer, [warm, decay], milestones=[3])
        run.states["lr_scheduler"] = run.scheduler
        return run

    run = build(0)
    for _ in range(4):
        run.step()
    manager(tmp_path).save(4, run.states)
    fresh = build(1)
    assert manager(tmp_path).load(fresh.states) == 4
    assert fresh.scheduler.last_epoch == 4 and fresh.scheduler._schedulers[1].last_epoch == 1
    assert fresh.optimizer.param_groups[0]["lr"] == run.optimizer.param_groups[0]["lr"]
    fresh.step(), run.step()
    assert fresh.optimizer.param_groups[0]["lr"] == run.optimizer.param_groups[0]["lr"]


# ------------------------------------------------------------------ hyperparameters on resume


def test_resume_takes_hyperparameters_from_the_config(tmp_path, capsys):
    from trainer.optim import build_lr_scheduler, lr_factor

    def run(**kw):
        r = Run(seed=0, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        r.optimizer = torch.optim.AdamW(r.model.parameters(), **{**r.optimizer_kw, **kw})
        r.scheduler = build_lr_scheduler(
            r.optimizer, total_steps=10, warmup_steps=2, decay_type="linear", decay_ratio=0.2, min_lr_factor=0.1
        )
        r.states.update(optimizer=ckpt.OptimizerState(r.model, r.optimizer), lr_scheduler=r.scheduler)
        return r

    ref = run()
    for step in range(1, 4):
        ref.step()
    manager(tmp_path).save(3, ref.states)
    moments = {k: v["exp_avg"].clone() for k, v in ref.optimizer.state.items()}
    capsys.readouterr()

    new = run(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)
    assert manager(tmp_path).load(new.states) == 3
    out = capsys.readouterr().out
    for group in new.optimizer.param_groups:
        assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.99), 1e-6, 0.0)
        # The config's lr for step 4 (same arithmetic as LambdaLR.step, so exact equality).
        assert group["lr"] == 5e-3 * lr_factor(
            4, total_steps=10, warmup_steps=2, decay_type="linear", decay_ratio=0.2, min_lr_factor=0.1
        )
        assert group["initial_lr"] == 5e-3
    # The moments still come from the checkpoint.
    for (p_ref, m), p_new in zip(moments.items(), new.optimizer.state):
        torch.testing.assert_close(new.optimizer.state[p_new]["exp_avg"], m, rtol=0, atol=0)
    assert "resumed from" in out and "lr, schedule, betas, eps and weight_decay from the config" in out
    for needle in (
        "optimizer.betas: checkpoint [0.9, 0.95] -> config [0.8, 0.99]",
        "optimizer.eps: checkpoint 1e-08 -> config 1e-06",
        "optimizer.weight_decay: checkpoint 0.1 -> config 0",
        "optimizer.lr (peak): checkpoint 0.01 -> config 0.005",
    ):
        assert needle in out, out

    # Unchanged config: nothing to report, and the lr is the checkpoint's to the bit.
    same = run()
    manager(tmp_path).load(same.states)
    out = capsys.readouterr().out
    assert "->" not in out
    assert same.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]


# ------------------------------------------------------------------ keys and shapes, both directions


@pytest.mark.parametrize("saved, loaded", [(3, 2), (2, 3)])
def test_resume_refuses_another_layer_count_either_way(tmp_path, saved, loaded):
    src = Run(n_layers=saved)
    src.step()
    manager(tmp_path).save(1, src.states)
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    needle = (
        "it has .* entries this run's model and optimizer lacks"
        if saved > loaded
        else "entries of this run's model and optimizer are not in it"
    )
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint.folder: .*step-1 does not match .*{needle} "
        r"\(first: model.layers.2.attention.wq.weight",
    ):
        manager(tmp_path).load(Run(n_layers=loaded).states)
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("saved, loaded", [(3, 2), (2, 3)])
def test_initial_weights_refuse_another_layer_count_either_way(tmp_path, saved, loaded):
    from safetensors.torch import save_file

    src = Run(n_layers=saved)
    manager(tmp_path / "run").save(1, src.states)
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path: .*does not match the model: .*layers.2"):
        ckpt.load_initial(TinyLM(n_layers=loaded), path=tmp_path / "run" / "step-1", fmt="dcp")
    save_file({hf_names(k): v.contiguous() for k, v in src.model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    names = list(TinyLM(n_layers=max(saved, loaded)).state_dict())
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path: .*does not match the model: .*layers.2"):
        ckpt.load_initial(
            TinyLM(n_layers=loaded), path=tmp_path / "m.safetensors", fmt="hf", hf_adapter=from_hf, args=names
        )


def test_shape_mismatch_names_the_first_entry(tmp_path):
    src = Run(dim=8)
    manager(tmp_path).save(1, src.states)
    with pytest.raises(
        ConfigError,
        match=r"differ in shape \(first: model.layers.0.attention.wq.weight is \[8, 8\] "
        r"there, \[12, 12\] in",
    ):
        manager(tmp_path).load(Run(dim=12).states)


def test_check_entries_orders_layers_naturally():
    exp = {f"layers.{i}.w": (2,) for i in range(12)}
    with pytest.raises(ConfigError, match=r"first: layers.10.w, layers.11.w\)"):
        ckpt.check_entries(
            expected={k: v for k, v in exp.items() if not k.startswith("layers.1")} | {"layers.1.w": (2,)},
            stored=exp,
            key="k",
            where="w",
        )


# ------------------------------------------------------------------ checksums


def _garble(path: Path) -> None:
    """Overwrite the middle of a file in place with same-size garbage (size and mtime-ish unchanged)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes((b + 1) % 256 for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def test_save_writes_a_manifest_and_load_verifies_it(tmp_path):
    run = Run()
    mgr = manager(tmp_path)
    for step in (1, 2):
        run.step()
        mgr.maybe_save(step, run.states)
    import json

    manifest = json.loads((tmp_path / "step-2" / ckpt.MANIFEST).read_text())
    names = {p.name for p in (tmp_path / "step-2").iterdir()} - {ckpt.MANIFEST}
    assert set(manifest["files"]) == names and ".metadata" in names
    assert ckpt.verify_checkpoint(tmp_path / "step-2") is True

    shard = next((tmp_path / "step-2").glob("*.distcp"))
    size = shard.stat().st_size
    _garble(shard)
    assert shard.stat().st_size == size
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint.folder: .*step-2 is corrupt: .*{shard.name} fails its checksum"
        r".*set checkpoint.load_step = 1 \(or checkpoint.fallback_on_corrupt = true\)",
    ):
        manager(tmp_path).load(Run().states)
    with pytest.raises(ConfigError, match=rf"checkpoint.load_step: .*step-2 is corrupt: .*{shard.name}"):
        manager(tmp_path, load_step=2, fallback_on_corrupt=True).load(Run().states)
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before

    # The explicit option falls back to the newest intact checkpoint.
    fresh = Run(seed=5)
    assert manager(tmp_path, fallback_on_corrupt=True).load(fresh.states) == 1
    # A truncated file and a missing one are caught by size/presence before any hashing.
    with pytest.raises(ConfigError, match="has 3 bytes"):
        shard.write_bytes(b"abc")
        manager(tmp_path, load_step=2).load(Run().states)
    shard.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        manager(tmp_path, load_step=2).load(Run().states)
    # A checkpoint without a manifest (written before checksums existed) still loads.
    (tmp_path / "step-1" / ckpt.MANIFEST).unlink()
    assert manager(tmp_path, load_step=1).load(Run().states) == 1
    # The only checkpoint corrupt: nothing older to offer.
    only = tmp_path / "only"
    manager(only).save(1, run.states)
    _garble(only / "step-1" / ".metadata")
    with pytest.raises(ConfigError, match=r"corrupt: .*\.metadata fails its checksum .*; no older checkpoint"):
        manager(only).load(Run().states)
    with pytest.raises(ConfigError, match="initial_load_path: .* is corrupt: .*.metadata"):
        ckpt.load_initial(TinyLM(), path=only / "step-1", fmt="dcp")


def test_async_save_writes_the_manifest(tmp_path):
    run = Run()
    run.step()
    mgr = manager(tmp_path, async_mode="async")
    mgr.maybe_save(1, run.states)
    mgr.close()
    assert ckpt.verify_checkpoint(tmp_path / "step-1") is True


def test_all_finite(tmp_path):
    run = Run()
    run.step()
    assert ckpt.all_finite(run.model, run.optimizer)
    with torch.no_grad():
        run.model.layers[1].feed_forward.w1.weight[0, 0] = float("nan")
    assert not ckpt.all_finite(run.model)
    run = Run()
    run.step()
    next(iter(run.optimizer.state.values()))["exp_avg_sq"].fill_(float("inf"))
    assert ckpt.all_finite(run.model) and not ckpt.all_finite(run.model, run.optimizer)


# ------------------------------------------------------------------ HF config.json vs the recipe


def _hf_folder(folder: Path, family_name: str, flavor: str, **overrides):
    """A Hugging Face folder (safetensors + config.json) of a small model of the family."""
    import json

    from safetensors.torch import save_file

    import models

    family = models.get_model_family(family_name)
    args = family.get_args(flavor, n_layers=1, **overrides)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    folder.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in family.hf_adapter.to_hf(model.state_dict(), args).items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(family.hf_adapter.hf_config(args)))
    return family, args, model


@pytest.mark.parametrize(
    "family_name, flavor, field, value, hf_key",
    [
        ("llama3", "debugmodel", "rope_theta", 10000.0, "rope_theta"),
        ("llama3", "debugmodel", "rope_scaling_factor", None, "rope_scaling"),
        ("llama3", "debugmodel", "rope_scaling_factor", 32.0, "rope_scaling"),
        ("llama3", "debugmodel", "rope_high_freq_factor", 2.0, "rope_scaling"),
        ("llama3", "debugmodel", "norm_eps", 1e-6, "rms_norm_eps"),
        ("qwen3", "debugmodel", "rope_theta", 10000.0, "rope_theta"),
        ("qwen3", "debugmodel_moe", "norm_topk_prob", False, "norm_topk_prob"),
    ],
)
def test_hf_weights_refuse_an_architecture_other_than_config_json(
    tmp_path, capsys, family_name, flavor, field, value, hf_key
):
    import dataclasses

    family, args, src = _hf_folder(tmp_path / "hf", family_name, flavor)
    assert getattr(args, field) != value
    recipe = dataclasses.replace(args, **{field: value}, max_seq_len=64)  # max_seq_len is not architecture
    model = family.model_cls(recipe)
    model.init_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint.initial_load_path: the recipe's model differs from "
        rf".*config.json: {hf_key}: config.json .*, recipe .*hf_config_mismatch",
    ):
        ckpt.load_initial(model, path=tmp_path / "hf", fmt="hf", hf_adapter=family.hf_adapter, args=recipe)
    assert_same(model.state_dict(), before)  # nothing loaded
    # The explicit option trains the recipe's model on these weights and says what differs.
    ckpt.load_initial(
        model, path=tmp_path / "hf", fmt="hf", hf_adapter=family.hf_adapter, args=recipe, hf_config_mismatch="override"
    )
    assert f"hf_config_mismatch = override: {hf_key} is" in capsys.readouterr().out
    assert_same(model.state_dict(), src.state_dict())
    # The same architecture (only the RoPE table length differs) loads without a word.
    same = dataclasses.replace(args, max_seq_len=64)
    ckpt.load_initial(family.model_cls(same), path=tmp_path / "hf", fmt="hf", hf_adapter=family.hf_adapter, args=same)
    assert capsys.readouterr().out == ""


def test_hf_weights_without_config_json(tmp_path, capsys):
    family, args, _ = _hf_folder(tmp_path / "hf", "llama3", "debugmodel")
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json not found, so the architecture .* cannot be checked"):
        ckpt.load_initial(
            family.model_cls(args), path=tmp_path / "hf", fmt="hf", hf_adapter=family.hf_adapter, args=args
        )
    ckpt.load_initial(
        family.model_cls(args),
        path=tmp_path / "hf",
        fmt="hf",
        hf_adapter=family.hf_adapter,
        args=args,
        hf_config_mismatch="override",
    )
    assert "not checked" in capsys.readouterr().out


LAYOUT = {"ranks_per_slice": 1, "slice_mesh": [1, 1, 1, 1], "ep": 1}


def tiered(tmp_path, **kw) -> ckpt.CheckpointManager:
    """A manager with both tiers: persistent every 4 steps, local every 2 (docs/checkpointing.md)."""
    kw = {"interval": 4, "local_folder": str(tmp_path / "host"), "local_interval": 2, "layout": LAYOUT, **kw}
    return manager(tmp_path / "ckpt", **kw)


def test_local_tier_newer_than_the_persistent_one_is_resumed(tmp_path, capsys):
    """7 steps: persistent step 4, local steps 4 and 6 (the newest 2 kept of 2, 4, 6). A resume
    takes local step 6 bit for bit (RNG included), says so in one line and in `resumed`; a
    local step that fails its checksums, or was written with another per-slice layout, leaves
    the persistent step 4."""
    ref = Run(seed=0)
    mgr = tiered(tmp_path)
    losses, params = [], {}
    for step in range(1, 8):
        losses.append(ref.step())
        if mgr.local_due(step):
            mgr.save_local(step, ref.states)
        mgr.maybe_save(step, ref.states)
        params[step] = ref.params()
    mgr.close()
    assert mgr.complete_steps() == [4]
    assert mgr.local.complete_steps() == [4, 6]
    assert sorted(p.name for p in (tmp_path / "host" / "rank-0").iterdir()) == ["step-4", "step-6"]
    assert (tmp_path / "host" / "rank-0" / "step-6" / ckpt.MANIFEST).is_file()
    assert set(mgr.take_save_seconds()) == {"ckpt_local_s", "ckpt_save_s"}

    resumed = Run(seed=123)
    torch.rand(7)
    mgr2 = tiered(tmp_path)
    capsys.readouterr()
    assert mgr2.load(resumed.states) == 6 and mgr2.resumed == {
        "tier": "local",
        "step": 6,
        "from_peer": 0,
        "peer_s": 0.0,
    }
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "resumed from" in x]
    assert line.startswith(f"checkpoint: resumed from the local tier {tmp_path / 'host'}/rank-*/step-6 (step 6; ")
    assert "; 0 of 1 ranks restored from a peer)" in line
    assert resumed.loader.pos == 6 and resumed.scheduler.last_epoch == 6
    assert_same(resumed.params(), params[6])
    assert resumed.step() == losses[6]  # the noise in the step: the RNG came back too

    other = tiered(tmp_path, layout={**LAYOUT, "slice_mesh": [1, 2, 1, 1]})
    assert other.load(Run(seed=1).states) == 4 and other.resumed == {"tier": "persistent", "step": 4}

    _garble(tmp_path / "host" / "rank-0" / "step-6" / "__0_0.distcp")
    fallback = Run(seed=2)
    mgr3 = tiered(tmp_path)
    capsys.readouterr()
    assert mgr3.load(fallback.states) == 4 and mgr3.resumed["tier"] == "persistent"
    out = capsys.readouterr().out
    assert "checkpoint: local tier step 6: " in out and "fails its checksum" in out
    assert_same(fallback.params(), params[4])


def test_plan_restore_picks_the_newest_step_every_replica_group_holds():
    """`plan_restore` over hand-made lists: 2 slices x 2 ranks (groups {0, 2} and {1, 3})."""
    plan = ckpt.plan_restore
    assert plan([[4, 6], [4, 6], [4, 6], [4, 6]], 2) == (6, {})  # nothing lost
    assert plan([[], [], [4, 6], [4, 6]], 2) == (6, {0: 2, 1: 3})  # slice 0 replaced
    assert plan([[4, 6], [], [4, 6], [6]], 2) == (6, {1: 3})  # one host replaced: its peer serves
    assert plan([[4, 6], [4], [6], [4]], 2) == (4, {2: 0})  # group {1, 3} has no 6: the newest both have
    assert plan([[2, 4], [2], [4], [4]], 2) == (4, {1: 3})  # the lowest holder of the group is the source
    assert plan([[], [], [], [6]], 2) == (0, {})  # group {0, 2} holds nothing: the persistent tier
    assert plan([[6], [6], [8], [8]], 4) == (0, {})  # one slice: every rank is its own group
    assert plan([[6], [6, 8], [6, 8], [8]], 1) == (8, {0: 1})  # 4 slices x 1 rank: the lowest holder of 8
    assert plan([[4, 6], [6], [], []], 2) == (6, {2: 0, 3: 1})


def _replaced_host_worker(rank: int, world: int, store: str, root: str):
    """2 slices x 1 rank (one replica group): local steps 2 and 4 on each rank's own "host", then
    resumes where rank 0's step 4 is gone, or one holder's or both holders' files are garbled."""
    import shutil

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    from trainer.runtime.device import cpu_backend

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=world)
    hosts = [Path(root) / f"host-{r}" for r in range(world)]

    def tiers():
        return ckpt.CheckpointManager(
            folder=Path(root) / "ckpt",
            interval=100,
            keep_latest_k=0,
            async_mode="disabled",
            enable=True,
            local_folder=str(hosts[rank]),
            local_interval=2,
            slice_rank=0,
            layout=LAYOUT,
        )

    try:
        run, mgr = Run(seed=0), tiers()
        for step in range(1, 5):
            run.step()  # the same seed on both ranks: the same replica, as after an all-reduce
            if step == 4:
                torch.manual_seed(1000 + rank)  # but each rank's own RNG from here on
            if mgr.local_due(step):
                mgr.save_local(step, run.states)
        mgr.close()
        want, want_rand = run.params(), torch.rand(3)  # the RNG right after the save

        def resume(expect_step: int, expect_from_peer: int) -> None:
            dist.barrier()
            fresh, again = Run(seed=7 + rank), tiers()
            assert again.load(fresh.states) == expect_step
            assert again.resumed == {"tier": "local", "step": expect_step, "from_peer": expect_from_peer} | {
                "peer_s": again.resumed["peer_s"]
            }
            if expect_step == 4:
                assert_same(fresh.params(), want)
                assert fresh.loader.pos == 4 and fresh.scheduler.last_epoch == 4 and fresh.train_state.step == 4
                torch.testing.assert_close(torch.rand(3), want_rand, rtol=0, atol=0)  # its own RNG
            again.close()
            dist.barrier()

        step4 = hosts[0] / "rank-0" / "step-4"
        if rank == 0:
            shutil.copytree(step4, Path(root) / "kept")
            shutil.rmtree(step4)  # a replaced host that has the older step only
        resume(4, 1)  # rank 0 receives step 4 from rank 1
        if rank == 0:
            shutil.copytree(Path(root) / "kept", step4)
            _garble(step4 / "__0_0.distcp")  # the lowest holder, the source, is corrupt
        resume(4, 1)  # rank 1's files serve instead: rank 0 receives
        if rank == 1:
            _garble(hosts[1] / "rank-0" / "step-4" / "__0_0.distcp")
        resume(2, 0)  # no intact step 4 anywhere: the older local step, newer than the persistent (none)
    finally:
        dist.destroy_process_group()


def test_replaced_host_receives_the_step_from_its_peer(tmp_path):
    """2 ranks on gloo, one replica group: a rank without the newest local step (a replaced host)
    receives it from the other, weights, moments, data position and its own RNG bit for bit; a
    corrupt source is passed over for the other holder; with none left, the older step."""
    import torch.multiprocessing as mp

    mp.spawn(_replaced_host_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


def test_explicit_load_step_reads_the_persistent_tier_only(tmp_path):
    run = Run()
    mgr = tiered(tmp_path)
    for step in range(1, 7):
        run.step()
        if mgr.local_due(step):
            mgr.save_local(step, run.states)
        mgr.maybe_save(step, run.states)
    assert tiered(tmp_path, load_step=4).load(Run(seed=3).states) == 4
    assert tiered(tmp_path, enable=False).local is None


def test_lost_peer_is_a_failed_collective_of_a_multi_rank_job(monkeypatch):
    import torch.distributed as dist

    from trainer.runtime import preemption

    gone = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert not preemption.lost_peer(gone)  # one process: there is no peer to lose
    monkeypatch.setattr(preemption.distributed, "multi_rank", lambda: True)
    assert preemption.lost_peer(gone)
    assert preemption.lost_peer(dist.DistBackendError("NCCL communicator was aborted"))
    assert preemption.lost_peer(RuntimeError("Timed out waiting 60000ms for recv operation to complete"))
    wrapped = ckpt.CheckpointSaveError("checkpoint: saving step 4 failed")
    wrapped.__cause__ = gone
    assert preemption.lost_peer(wrapped)
    assert not preemption.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not preemption.lost_peer(ValueError("Connection closed by peer"))
