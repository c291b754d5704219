"""The engine API (trainer/engine.py): the trainer's step, accumulation, DCP, HF weight export, GRPO.

All runs are fp32 (training.mixed_precision_param = float32) on the 2-layer debug Llama 3 with
SDPA attention, so differences come from summation order only. Bounds, and why:
- loss: engine (log-softmax, gather as a cross entropy with no reduction, then mean) vs the
  trainer (cross entropy, mean) or vs another batch split: the same fp32 terms summed in another
  order; a mean of ~100 terms of size ~8 is exact to a few ulps: rel 1e-6.
- weights after AdamW steps (lr = 1e-4, the first warmup step): the first update is
  lr * g / (|g| + eps), sign-like and blind to a gradient's last bits, except where |g| ~ eps
  (1e-8): there a change dg moves the update by up to lr * |dg| / eps, and by at most 2 * lr
  (a flipped sign). Summation-order changes (another batch split, TP partial sums) give
  |dg| <~ 1e-9 for gradient contributions <~ 1e-2, so such elements move <= 0.1 * lr = 1e-5,
  and they are rare: asserted every element within 1e-5 and at most 1e-3 of each tensor's
  elements beyond 1e-7 (+ rtol 1e-5). Measured worst: 0 (engine vs trainer: bit-identical
  weights after 2 steps), 3.0e-7 (two calls vs one), 3.2e-6 (tp=2 vs 1 rank, 24 of 196608
  elements beyond 1e-7), 3.4e-6 (dp_shard=2 x tp=2).
- a DCP round trip and the HF export are copies: asserted exactly equal.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.trainer_runs import ENV, REPO, read_metrics

RECIPE = "configs/llama3_debug.toml"
SEQ = 32
COMMON = [
    "model.n_layers=2",
    "model.attn_backend=sdpa",
    f"training.seq_len={SEQ}",
    "training.mixed_precision_param=float32",
    "metrics.log_freq=1",
    "validation.enable=false",
    "metrics.enable_tensorboard=false",
]
LR = 1e-4


def assert_weights_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """See the module docstring: all within 0.1 * lr, at most 1e-3 of the elements beyond 1e-7."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0.1 * LR, msg=name)
    beyond = ((actual - expected).abs() > 1e-7 + 1e-5 * expected.abs()).float().mean().item()
    assert beyond <= 1e-3, f"{name}: {beyond:.1e} of the elements differ by more than 1e-7"


LOSS = dict(rtol=1e-6, atol=0.0)


def _engine(*extra: str, recipe: str = RECIPE):
    from trainer.engine import Engine

    return Engine.from_recipe(recipe, [*COMMON, *extra])


def _params(engine) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _tokens(rows: int, vocab: int = 4096, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def test_engine_steps_equal_the_trainers_steps(tmp_path):
    """Two trainer steps (trainer.train.main, its loader's batches) vs the engine on the same batches:
    loss and grad norm per step, and the weights in the trainer's step-2 checkpoint."""
    from trainer.data import build_dataloader
    from trainer.data.tokenizer import build_tokenizer
    from trainer.engine import nll_loss
    from trainer.train import main

    dump = tmp_path / "run"
    run = [
        *COMMON,
        "training.steps=2",
        "training.local_batch_size=2",
        "checkpoint.enable=true",
        "checkpoint.interval=2",
        f"job.dump_folder={dump}",
    ]
    assert main(["--config", RECIPE, *[f"--{o}" for o in run]]) == 0
    metrics = read_metrics(dump)

    engine = _engine("training.steps=2", "training.local_batch_size=2")
    loader = build_dataloader(
        dataset="bundled",
        tokenizer=build_tokenizer("bundled"),
        seq_len=SEQ,
        local_batch_size=2,
        dp_rank=0,
        dp_degree=1,
        seed=42,
    )
    for step in (1, 2):
        inputs, labels = loader.next_batch()
        tokens = torch.cat([inputs, labels[:, -1:]], dim=1)  # the loader's window of SEQ + 1 tokens
        assert torch.equal(tokens[:, 1:], labels)
        out = engine.forward_backward({"tokens": tokens}, nll_loss)
        stepped = engine.optimizer_step()
        torch.testing.assert_close(out["loss"], metrics[step]["loss"], **LOSS)
        torch.testing.assert_close(stepped["grad_norm"], metrics[step]["grad_norm"], rtol=1e-5, atol=0.0)
        assert stepped["lr"] == pytest.approx(metrics[step]["lr"], rel=1e-12)
    trained = _params(engine)

    # The trainer's checkpoint (with its data-loader state, which the engine does not read).
    other = _engine("training.steps=2")
    assert other.load(dump / "checkpoints") == 2 and other.step == 2
    reference = _params(other)
    assert reference.keys() == trained.keys()
    for name in trained:
        assert_weights_close(trained[name], reference[name], name)
    other.close()


def test_accumulation_over_two_calls_equals_one_call_on_the_concatenated_batch():
    from trainer.engine import nll_loss

    tokens = _tokens(4)
    one = _engine()
    whole = one.forward_backward({"tokens": tokens}, nll_loss)["loss"]
    norm_one = one.optimizer_step()["grad_norm"]
    after_one = _params(one)

    two = _engine()
    halves = [two.forward_backward({"tokens": tokens[i : i + 2]}, nll_loss)["loss"] for i in (0, 2)]
    norm_two = two.optimizer_step()["grad_norm"]
    torch.testing.assert_close(sum(halves) / 2, whole, **LOSS)
    torch.testing.assert_close(norm_two, norm_one, rtol=1e-5, atol=0.0)
    for name, value in _params(two).items():
        assert_weights_close(value, after_one[name], name)

    two.close()

    # Token weights: a call scoring 1 token per row and one scoring the other SEQ - 1, weighted by
    # their token counts, equal the unmasked call on the whole batch (a per-token mean).
    first = torch.zeros(4, SEQ)
    first[:, 0] = 1
    masked = _engine()
    for mask in (first, 1 - first):
        masked.forward_backward({"tokens": tokens, "loss_mask": mask}, nll_loss, weight=float(mask.sum()))
    torch.testing.assert_close(masked.optimizer_step()["grad_norm"], norm_one, rtol=1e-5, atol=0.0)
    for name, value in _params(masked).items():
        assert_weights_close(value, after_one[name], name)
    masked.close()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("activation_checkpoint.mode=full",), id="ac-full"),
        pytest.param(("compile.mode=compile", "compile.backend=aot_eager"), id="compile-aot_eager"),
    ],
)
def test_block_modes_leave_the_step_unchanged(extra):
    """The recipe's activation checkpointing / per-block compile reach the blocks (as the trainer's
    parallelize_model applies them) and compute the same fp32 step and log-probs as plain eager."""
    from trainer.engine import nll_loss

    tokens = _tokens(2)
    results = []
    for overrides in ((), extra):
        engine = _engine(*overrides)
        loss = engine.forward_backward({"tokens": tokens}, nll_loss)["loss"]
        engine.optimizer_step()
        results.append((loss, _params(engine), engine.compute_logprobs(tokens)))
    blocks = [block for _, block in engine.family.plan.iter_blocks(engine.model)]
    if "activation_checkpoint.mode=full" in extra:
        assert blocks and all(getattr(type(b), "_ac_mode", None) == "full" for b in blocks)
    else:
        assert engine.step_plan.block_compile == "aot_eager"
    engine.close()
    (loss_plain, plain, logp_plain), (loss, weights, logp) = results
    torch.testing.assert_close(loss, loss_plain, **LOSS)
    # The same ops in the same order (AC recomputes them, aot_eager runs the traced ops one by
    # one): measured identical; 1e-6 leaves room for a backend that reorders a reduction.
    torch.testing.assert_close(logp, logp_plain, rtol=1e-6, atol=1e-6)
    for name, value in weights.items():
        assert_weights_close(value, plain[name], name)


def test_save_load_round_trip(tmp_path):
    from models.errors import ConfigError

    tokens = _tokens(2)
    a = _engine()
    a.forward_backward({"tokens": tokens})
    a.optimizer_step()
    path = a.save(tmp_path / "ckpt")
    assert path.name == "step-1" and (path / ".metadata").is_file()
    saved = _params(a)
    a.forward_backward({"tokens": tokens})
    next_a = a.optimizer_step()
    after_a = _params(a)

    b = _engine()
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        b.load(tmp_path / "empty")
    # Gradients accumulated before a load belong to other weights: load drops them, so the
    # step below equals a's (it would not with these stale gradients added in).
    b.forward_backward({"tokens": _tokens(2, seed=1)})
    assert b.load(tmp_path / "ckpt") == 1 and b.step == 1
    assert all(p.grad is None for p in b.model.parameters())
    for name, value in _params(b).items():
        assert torch.equal(value, saved[name]), name
    b.forward_backward({"tokens": tokens})
    next_b = b.optimizer_step()
    assert next_b == next_a  # same loss, grad norm, lr and step: the moments came back too
    for name, value in _params(b).items():
        assert torch.equal(value, after_a[name]), name
    b.close()


@pytest.mark.parametrize("recipe", [RECIPE, "configs/qwen3_moe_debug.toml"], ids=["llama3", "qwen3_moe"])
def test_hf_state_dict_is_the_adapters_export(recipe):
    """Full: the names and values of `hf_adapter.to_hf(full state dict)`, one tensor at a time.
    Sharded on one rank: every tensor whole, at offset 0 (stacked experts split per expert)."""
    engine = _engine(recipe=recipe)
    expected = engine.family.hf_adapter.to_hf(_params(engine), engine.args)
    got = list(engine.hf_state_dict())
    assert [name for name, _ in got] == list(expected)
    for name, value in got:
        assert torch.equal(value, expected[name]), name
    shards = {name: (value, info) for name, value, info in engine.hf_state_dict(sharded=True)}
    assert shards.keys() == expected.keys()
    for name, (value, info) in shards.items():
        assert info.offset == (0,) * value.ndim and info.global_shape == tuple(expected[name].shape)
        assert torch.equal(value, expected[name]), name
    assert all(v.dtype == torch.bfloat16 for _, v in engine.hf_state_dict(dtype=torch.bfloat16))
    if engine.args.shape().is_moe:
        assert any(".mlp.experts.3.up_proj.weight" in name for name in expected)
    engine.close()


def test_tied_embeddings_export_has_no_lm_head():
    engine = _engine("model.tie_embeddings=true")
    expected = engine.family.hf_adapter.to_hf(_params(engine), engine.args)
    got = dict(engine.hf_state_dict())
    assert "lm_head.weight" not in got and got.keys() == expected.keys()
    assert {name for name, _, _ in engine.hf_state_dict(sharded=True)} == set(expected)
    engine.close()


def test_weight_sync_into_transformers_gives_the_engines_logprobs():
    """After a step, `LlamaForCausalLM` loaded from `hf_state_dict()` (strict) gives the engine's
    log-probs: the weight sync an RL loop does into an inference engine. Two fp32 implementations
    of the same math (HF eager attention vs SDPA): tests/unit/test_models_parity.py bounds the logits
    by 1e-5, so the log-softmax differs by <= 2e-5; asserted 5e-5 (measured 1.9e-6)."""
    import transformers

    engine = _engine()
    tokens = _tokens(2)
    engine.forward_backward({"tokens": tokens})
    engine.optimizer_step()
    config = transformers.LlamaConfig(**engine.family.hf_adapter.hf_config(engine.args))
    config._attn_implementation = "eager"
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.load_state_dict(dict(engine.hf_state_dict()), strict=True)
    with torch.no_grad():
        logits = hf_model(tokens[:, :-1]).logits
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    got = engine.compute_logprobs(tokens)
    assert (got - expected).abs().max().item() <= 5e-5
    engine.close()


def test_bad_input_is_a_config_error():
    from models.errors import ConfigError
    from trainer.engine import Engine

    with pytest.raises(ConfigError, match="compile.mode"):
        Engine.from_recipe(RECIPE, [*COMMON, "compile.mode=graph"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        Engine.from_recipe(RECIPE, ["n_layers=2"])


# --- 1 rank vs 2 ranks (torchrun) ------------------------------------------------------------------


def _worker(out: str) -> None:
    """Under torchrun: one step on this rank's half of a fixed global batch, then both exports."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.engine import Engine

    engine = Engine.from_recipe(sys.argv[3], [*COMMON, *sys.argv[4:]])
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = engine.parallel_dims.dp_degree
    tokens = _tokens(4)
    dp_rank = engine.parallel_dims.dp_rank(engine.mesh)
    rows = tokens.shape[0] // dp
    mine = tokens[dp_rank * rows : (dp_rank + 1) * rows]
    # An all-ones mask: the same loss, through the masked path (a plain tensor times the log-probs).
    before = engine.forward_backward({"tokens": mine, "loss_mask": torch.ones(rows, SEQ)})["loss"]
    stepped = engine.optimizer_step()
    # One parameter is gathered when the generator yields its first tensor, not the whole model.
    gathers = []
    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: (gathers.append(1), full_tensor(self, *a, **k))[1]
    export = engine.hf_state_dict()
    first = next(export)
    gathers_before_first = len(gathers)
    DTensor.full_tensor = full_tensor
    full = {name: value.clone() for name, value in [first, *export]}
    shards = [
        (name, value.clone(), info.global_shape, info.offset)
        for name, value, info in engine.hf_state_dict(sharded=True)
    ]
    torch.save(shards, os.path.join(out, f"shards_rank{rank}.pt"))
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(
                {
                    "loss": before,
                    "grad_norm": stepped["grad_norm"],
                    "world": world,
                    "gathers_before_first": gathers_before_first,
                },
                f,
            )
    # Both ranks done before either tears its process group down: once (2026-12-02 at `6ab6fe2`, loaded CI
    # machine) rank 0 aborted here with "terminate called without an active exception" while
    # rank 1 was still exporting; not reproduced, so this is a guess at the cause.
    dist.barrier()
    engine.close()


def _launch(out, nproc: int, recipe: str, *extra: str) -> dict:
    os.makedirs(out, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.join(REPO, "tests", "e2e", "test_engine.py"),
        "--worker",
        str(out),
        recipe,
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def _reassemble(out, nproc: int, full: dict) -> None:
    """The shards of all ranks tile every full tensor exactly once and equal it."""
    cover = {name: torch.zeros(value.shape, dtype=torch.int32) for name, value in full.items()}
    built = {name: torch.zeros_like(value) for name, value in full.items()}
    for rank in range(nproc):
        for name, value, global_shape, offset in torch.load(os.path.join(out, f"shards_rank{rank}.pt")):
            assert tuple(full[name].shape) == tuple(global_shape), name
            index = tuple(slice(o, o + n) for o, n in zip(offset, value.shape))
            built[name][index] = value
            cover[name][index] += 1
    for name in full:
        assert bool((cover[name] == 1).all()), f"{name}: covered {cover[name].min()}..{cover[name].max()} times"
        assert torch.equal(built[name], full[name]), name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The 1-rank run of each recipe, launched once."""
    runs = {}

    def get(recipe: str) -> dict:
        if recipe not in runs:
            folder = tmp_path_factory.mktemp("one")
            runs[recipe] = {**_launch(folder, 1, recipe, "training.aux_loss_coef=0"), "folder": folder}
        return runs[recipe]

    return get


MOE = "configs/qwen3_moe_debug.toml"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "recipe, nproc, degrees",
    [
        pytest.param(RECIPE, 2, ("parallelism.data_parallel_shard_degree=2",), id="fsdp2"),
        pytest.param(
            RECIPE,
            2,
            ("parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=1"),
            id="tp2",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            RECIPE,
            2,
            (
                "parallelism.tensor_parallel_degree=2",
                "parallelism.data_parallel_shard_degree=1",
                "parallelism.enable_loss_parallel=true",
            ),
            id="tp2-loss-parallel",
            marks=pytest.mark.slow,
        ),
        # Replicas: each tensor is yielded by one rank of the dp_replicate axis only.
        pytest.param(
            RECIPE,
            2,
            ("parallelism.data_parallel_replicate_degree=2", "parallelism.data_parallel_shard_degree=1"),
            id="hsdp-replicate2",
            marks=pytest.mark.slow,
        ),
        # 2-D (dp_shard, tp): the dp shard of a TP shard (_StridedShard) is still one block.
        pytest.param(
            RECIPE,
            4,
            ("parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=2"),
            id="fsdp2-tp2",
            marks=pytest.mark.slow,
        ),
        # Stacked experts [8, ...] split over ranks: per-expert HF tensors at the right global index.
        # No load-balancing loss: it is a product of per-batch fractions, so half batches on two
        # ranks give another (equally valid) gradient than the whole batch on one.
        pytest.param(
            MOE,
            2,
            ("parallelism.data_parallel_shard_degree=2", "training.aux_loss_coef=0"),
            id="moe-fsdp2",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            MOE,
            2,
            (
                "parallelism.data_parallel_shard_degree=2",
                "parallelism.expert_parallel_degree=2",
                "training.aux_loss_coef=0",
            ),
            id="moe-ep2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_hf_export_one_rank_equals_two_ranks(tmp_path, one_rank, recipe, nproc, degrees):
    one = one_rank(recipe)
    two = _launch(tmp_path / "two", nproc, recipe, *degrees)
    assert (one["world"], two["world"]) == (1, nproc)
    assert two["gathers_before_first"] == 1  # one parameter at a time
    torch.testing.assert_close(two["loss"], one["loss"], **LOSS)
    torch.testing.assert_close(two["grad_norm"], one["grad_norm"], rtol=1e-5, atol=0.0)
    full_one = torch.load(one["folder"] / "full.pt")
    full_two = torch.load(tmp_path / "two" / "full.pt")
    assert list(full_two) == list(full_one)
    for name in full_one:
        assert_weights_close(full_two[name], full_one[name], name)
    _reassemble(tmp_path / "two", nproc, full_two)
    _reassemble(one["folder"], 1, full_one)


def test_grpo_example_reward_rises():
    """Six seeded GRPO updates (2 optimizer steps each) on the 64-token debug model: the mean
    reward (fraction of the target token) of the last two updates beats the first two by 0.3.
    Measured: 0.035, 0.051 -> 0.359, 0.949 (the chance level is 1/64 = 0.016)."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import grpo_debug

    rows = grpo_debug.run(["--updates", "6"])
    rewards = [row["reward"] for row in rows]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.3, rewards


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])


# --- the API contract: loads drop pending gradients, misuse is one EngineError, nothing changed ----


def test_load_and_load_state_dict_drop_pending_gradients(tmp_path):
    """Issue 29: gradients accumulated before a load were applied to the loaded weights at the
    next step. The step after a load must be the checkpoint's own step, whatever was pending,
    and a second load into the same engine must work (it used to refuse: the schedule's
    `resume_notes` entered its state dict)."""
    e = _engine()
    e.forward_backward({"tokens": _tokens(2)})
    e.optimizer_step()
    e.save(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in e.state_dict()["model"].items()}
    e.forward_backward({"tokens": _tokens(2)})
    want = e.optimizer_step()
    for load in (
        lambda: e.load(tmp_path / "ckpt"),
        lambda: e.load(tmp_path / "ckpt"),
        lambda: e.load_state_dict({"model": saved, "train_state": {"step": 1}}),
    ):
        e.forward_backward({"tokens": _tokens(2, seed=1)})  # pending, computed on other weights
        assert e.pending_gradients
        load()
        assert not e.pending_gradients and all(p.grad is None for p in e.model.parameters())
        e.forward_backward({"tokens": _tokens(2)})
        got = e.optimizer_step()
        # Same weights, same batch: the same fp32 gradient norm exactly (stale gradients added
        # in gave 24.93 vs 16.44 before the fix).
        assert got["grad_norm"] == want["grad_norm"]
    e.close()


def _misuses(vocab: int):
    good = {"tokens": _tokens(2)}
    return [
        ("optimizer_step", lambda e: e.optimizer_step(), "no gradients"),
        ("weight nan", lambda e: e.forward_backward(good, weight=float("nan")), "weight = nan"),
        ("weight 0", lambda e: e.forward_backward(good, weight=0), "weight = 0"),
        ("weight str", lambda e: e.forward_backward(good, weight="1"), "weight = '1'"),
        ("temperature inf", lambda e: e.forward_backward(good, temperature=float("inf")), "temperature = inf"),
        ("output", lambda e: e.forward_backward(good, output="probs"), "output = 'probs'"),
        ("no tokens", lambda e: e.forward_backward({"ids": good["tokens"]}), "no 'tokens'"),
        ("float tokens", lambda e: e.forward_backward({"tokens": good["tokens"].float()}), "expected int64"),
        ("one token", lambda e: e.forward_backward({"tokens": good["tokens"][:, :1]}), "at least 2 tokens"),
        (
            "too long",
            lambda e: e.forward_backward({"tokens": torch.zeros(1, SEQ + 2, dtype=torch.int64)}),
            "raise training.seq_len",
        ),
        ("id >= vocab", lambda e: e.forward_backward({"tokens": torch.full((1, 4), vocab)}), f"0..{vocab - 1}"),
        ("id < 0", lambda e: e.compute_logprobs(torch.full((1, 4), -1)), f"0..{vocab - 1}"),
        ("list tokens", lambda e: e.next_token_logits([[1, 2]]), "expected int64"),
        ("vector loss", lambda e: e.forward_backward(good, lambda x, b: -x.mean(dim=1)), "shape [2]"),
        ("constant loss", lambda e: e.forward_backward(good, lambda x, b: torch.tensor(1.0)), "requires_grad=False"),
        ("state dict", lambda e: e.load_state_dict({"weights": {}}), "allowed: a mapping with some of"),
    ]


def test_every_misuse_is_one_engine_error_and_changes_nothing():
    from models.errors import ConfigError
    from trainer.engine import EngineError

    e = _engine()
    assert issubclass(EngineError, ConfigError)
    e.forward_backward({"tokens": _tokens(2, seed=3)})  # pending: every refusal below must keep it
    grads = {n: p.grad.clone() for n, p in e.model.named_parameters()}
    weights = _params(e)
    for name, call, match in _misuses(e.args.vocab_size):
        if name == "optimizer_step":
            continue  # needs no pending gradients: below
        with pytest.raises(EngineError, match=re.escape(match)):
            call(e)
        assert e.pending_gradients, name
        assert all(torch.equal(p.grad, grads[n]) for n, p in e.model.named_parameters()), name
    assert all(torch.equal(v, weights[k]) for k, v in _params(e).items())
    e.zero_grad()
    with pytest.raises(EngineError, match="no gradients"):
        e.optimizer_step()
    assert e.step == 0
    e.close()
    for call in (
        lambda: e.forward_backward({"tokens": _tokens(2)}),
        e.optimizer_step,
        e.state_dict,
        lambda: e.save("unused"),
        lambda: e.load("unused"),
        lambda: next(e.hf_state_dict()),
    ):
        with pytest.raises(EngineError, match="closed"):
            call()
    assert not os.path.exists("unused")


def test_a_failed_load_blocks_every_call_until_a_load_succeeds(tmp_path, monkeypatch):
    from trainer import checkpoint as ckpt
    from trainer.engine import EngineError

    e = _engine()
    e.save(tmp_path / "ckpt")
    real = ckpt.CheckpointManager.load

    def half_load(self, states):  # the first tensor overwritten, then the disk fails
        next(iter(e.model.parameters())).data.add_(1.0)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt.CheckpointManager, "load", half_load)
    e.forward_backward({"tokens": _tokens(2)})
    with pytest.raises(OSError):
        e.load(tmp_path / "ckpt")
    assert not e.pending_gradients
    for call in (
        lambda: e.forward_backward({"tokens": _tokens(2)}),
        lambda: e.save(tmp_path / "other"),
        lambda: e.compute_logprobs(_tokens(1)),
    ):
        with pytest.raises(EngineError, match="the last load from .* failed .*Input/output error.* partly overwritten"):
            call()
    assert not (tmp_path / "other").exists()
    monkeypatch.setattr(ckpt.CheckpointManager, "load", real)
    assert e.load(tmp_path / "ckpt") == 0
    e.forward_backward({"tokens": _tokens(2)})
    assert e.optimizer_step()["step"] == 1
    e.close()


def test_a_failed_backward_drops_the_pending_gradients():
    """Part of a backward may have added into .grad before it failed; the engine cannot tell
    which part, so it drops every pending gradient, and the next step starts clean."""

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise MemoryError("injected")

    e = _engine()
    e.forward_backward({"tokens": _tokens(2)})
    with pytest.raises(MemoryError, match="injected"):
        e.forward_backward({"tokens": _tokens(2)}, lambda x, b: -FailingBackward.apply(x).mean())
    assert not e.pending_gradients and all(p.grad is None for p in e.model.parameters())
    e.forward_backward({"tokens": _tokens(2)})
    assert e.optimizer_step()["step"] == 1
    e.close()
