"""Auxiliary-loss-free load balancing (trainer/optim/expert_balance.py): the bias step, its gating,
the MaxVio metric, and the bias trajectory of real training runs across meshes and modes.

Bias parity is exact, not a tolerance: each step moves a bias by exactly +-rate or 0, decided by
integer token counts summed over the ranks (float32 holds them exactly here). Two runs agree
bit for bit as long as every routing decision agrees; the logits of the runs compared here
agree within ~1e-6 relative (tests/e2e/test_deepseek_v3.py), so a decision flips only where two
biased router scores are within ~1e-6 of a tie. That happens when the bias, not the score,
decides: at a high lr the debug model's routers collapse onto few experts within steps and
`rate` = 0.01 steps then outweigh the score spread (seen with TP at lr 3e-3: the same MaxVio
curve, two biases one step apart). The runs here use lr 3e-4 and DeepSeek's rate 0.001, where
the scores decide; a flip would show as a difference of 2 x rate = 2e-3, far above the 1e-9
asserted.
"""

import glob
import os

import pytest
import torch

from models.common.moe import MoE, use_capacity
from models.common.stack import BlockStack
from tests.support.trainer_runs import train
from trainer.optim.expert_balance import ExpertBalance

STEPS = 4
RATE = 0.001
COMMON = [
    "--config",
    "configs/deepseek_v3_debug.toml",
    f"--training.steps={STEPS}",
    "--training.seq_len=64",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--checkpoint.interval=2",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=2",
    f"--training.expert_bias_rate={RATE}",
    "--optimizer.lr=3e-4",
]


class _Block(torch.nn.Module):
    def __init__(self, biased: bool):
        super().__init__()
        self.moe = MoE(dim=8, hidden_dim=8, num_experts=4, top_k=1, norm_topk_prob=False, expert_bias=biased)

    def forward(self, h):
        out, aux, load = self.moe(h)
        return h + out, aux, load


def test_finish_moves_biases_by_the_global_load_and_reports_maxvio():
    torch.manual_seed(0)
    stack = BlockStack([_Block(True), _Block(True)])
    balance = ExpertBalance(stack, rate=0.5)
    stack(torch.randn(1, 6, 8))
    load = balance.pop()
    assert load.shape == (8,) and load.view(2, 4).sum(1).tolist() == [6.0, 6.0]
    with pytest.raises(AssertionError):  # popped once per forward
        balance.pop()
    load = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 2.0])
    vio = balance.finish(load).max_vio
    # layer 0: mean 1.5, max 3 -> 1.0; layer 1: mean 1.5, max 2 -> 1/3
    assert vio.item() == pytest.approx((1.0 + 1 / 3) / 2)
    assert stack["0"].moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert stack["1"].moe.router.expert_bias.tolist() == [0.5, -0.5, -0.5, -0.5]
    balance.finish(load, apply=torch.tensor(False))  # a skipped step leaves the bias
    assert stack["0"].moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


def test_unbiased_routers_only_report():
    """Qwen 3 MoE without `moe_expert_bias`: the load is still measured (MaxVio), nothing moves."""
    stack = BlockStack([_Block(False)])
    balance = ExpertBalance(stack, rate=0.5)
    assert balance and not balance.biased
    assert balance.finish(torch.tensor([4.0, 0.0, 0.0, 0.0])).max_vio.item() == pytest.approx(3.0)


def test_capacity_loads_carry_the_dropped_copies():
    """Under a capacity each layer's load ends with its dropped copies: the balance step and MaxVio
    see the routed loads only; the step's dropped count and share are the sum over layers."""
    stack = BlockStack([_Block(True), _Block(True)])
    use_capacity(stack, 1.0)
    balance = ExpertBalance(stack, rate=0.5)
    stats = balance.finish(torch.tensor([3.0, 1.0, 1.0, 1.0, 2.0, 0.0, 2.0, 2.0, 2.0, 1.0]))
    assert stats.max_vio.item() == pytest.approx((1.0 + 1 / 3) / 2)
    assert stack["0"].moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert stats.dropped.item() == 3.0 and stats.dropped_pct.item() == pytest.approx(100 * 3 / 12)


def _biases(folder) -> dict[str, torch.Tensor]:
    """The selection biases in the run's newest checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = max(glob.glob(os.path.join(folder, "checkpoints", "step-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    out = os.path.join(folder, "state.pt")
    dcp_to_torch_save(step, out)
    state = torch.load(out, weights_only=False)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    return {k: v for k, v in flat(state) if k.endswith("router.expert_bias")}


def _run(folder, nproc: int, degrees: dict, *extra: str):
    records = train(folder, nproc, degrees, *COMMON, *extra)
    return [records[s]["moe_max_vio"] for s in range(1, STEPS + 1)], _biases(folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    vio, biases = _run(tmp_path_factory.mktemp("ref"), 1, {})
    assert len(biases) == 3  # the debug model's three MoE layers
    for b in biases.values():
        # Each step moves each bias by exactly 0 or +-rate.
        steps = b / RATE
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= STEPS
    assert any(b.abs().sum() > 0 for b in biases.values())
    assert all(v >= 0 for v in vio)
    return vio, biases


def _assert_same(got, want):
    (vio, biases), (want_vio, want_biases) = got, want
    assert vio == pytest.approx(want_vio, abs=1e-6)
    assert biases.keys() == want_biases.keys()
    for k in biases:
        assert torch.allclose(biases[k], want_biases[k], rtol=0, atol=1e-9), k


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "degrees, extra",
    [
        pytest.param(dict(dp_shard=2), (), id="fsdp2"),
        pytest.param(dict(tp=2), (), id="tp2"),
        pytest.param(dict(dp_shard=2, ep=2), (), id="ep2", marks=pytest.mark.slow),
        pytest.param({}, ("--parallelism.context_parallel_degree=2",), id="cp2", marks=pytest.mark.exhaustive),
    ],
)
def test_bias_trajectory_matches_single_process(tmp_path, reference, degrees, extra):
    """SimpleFSDP (ranks route different sequences), TP (each rank routes its sequence shard),
    EP (tokens counted before dispatch), CP (each rank holds two chunks of every sequence)."""
    _assert_same(_run(tmp_path, 2, degrees, *extra), reference)


def test_graph_mode_scan_bias_matches_eager(tmp_path, reference):
    """The loads leave the captured graph as a layer-scan output; the update runs after it."""
    _assert_same(
        _run(tmp_path, 1, {}, "--compile.mode=graph", "--compile.backend=aot_eager", "--compile.scan_layers=true"),
        reference,
    )


def test_resume_continues_the_bias_trajectory(tmp_path, reference):
    """The bias is in the checkpoint: stop after step 2, resume to 4, same biases as one run."""
    train(tmp_path, 1, {}, *COMMON, "--training.steps=2")
    records = train(tmp_path, 1, {}, *COMMON)
    assert [records[s]["moe_max_vio"] for s in (3, 4)] == pytest.approx(reference[0][2:], abs=1e-6)
    assert all(torch.equal(b, reference[1][k]) for k, b in _biases(tmp_path).items())


def test_engine_optimizer_step_moves_the_biases():
    """The RL engine sums the loads of its forward_backward calls and updates the biases in
    optimizer_step, as the trainer's step does (Qwen 3 MoE with `moe_expert_bias`)."""
    from trainer.engine import Engine

    engine = Engine.from_recipe(
        "configs/qwen3_moe_debug.toml",
        [
            "model.moe_expert_bias=true",
            "training.seq_len=32",
            "training.mixed_precision_param=float32",
            "checkpoint.enable=false",
            "metrics.enable_tensorboard=false",
            f"training.expert_bias_rate={RATE}",
        ],
    )
    tokens = [torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    routers = [m.router for m in engine.model.modules() if isinstance(m, MoE)]
    balance = ExpertBalance(engine.model, rate=RATE)
    want = 0
    with torch.no_grad():  # the loads the two calls will route (weights do not change before the step)
        for t in tokens:
            engine.model(t[:, :-1])
            engine.model.pop_aux_loss()
            want = want + balance.pop()
    for t in tokens:
        engine.forward_backward({"tokens": t}, weight=1.0)
    out = engine.optimizer_step()
    assert out["moe_max_vio"] >= 0
    got = torch.cat([r.expert_bias for r in routers])
    want_bias = torch.cat([torch.sign(l.mean() - l) * RATE for l in want.view(len(routers), -1)])
    assert torch.equal(got, want_bias) and got.abs().sum() > 0
    engine.close()
