"""Multi-token prediction of DeepSeek-V3 / Kimi K2 (`[model] mtp_depth`, DeepSeek-V3 section 2.2).

The MTP loss against a hand-written reference of the paper's equations (truncated sequences, one
module per depth), the model and loss unchanged with `mtp_depth = 0`, the gradient reaching the
shared embedding through the MTP path, the HF layout of V3's MTP layer both ways, the keys'
checks and rules, the counts, and a short debug run that logs each depth's loss.
"""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from models import FAMILIES
from models.deepseek_v3 import hf_adapter as ds_hf
from models.deepseek_v3.args import DeepSeekV3Args
from models.errors import ConfigError
from trainer.config import build_config
from trainer.job import plan_job
from trainer.step.loss import IGNORE_INDEX, MTPLoss, lm_loss_fn, model_lm_loss, mtp_targets
from trainer.step.plan import StepRequest, refusals

FAMILY = FAMILIES["deepseek_v3"]
SEQ = 16
VOCAB = 256


def _model(depth: int, seed: int = 0, **overrides):
    args = FAMILY.get_args(
        "debugmodel",
        n_layers=3,
        n_dense_layers=1,
        dim=64,
        n_heads=2,
        hidden_dim=128,
        q_lora_rank=32,
        kv_lora_rank=32,
        moe_hidden_dim=32,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        mtp_depth=depth,
        **overrides,
    )
    torch.manual_seed(seed)
    model = FAMILY.model_cls(args)
    model.init_weights()
    return model


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def _run_block(block, h, cos, sin):
    out = block(h, cos, sin)
    return out[0] if isinstance(out, tuple) else out


def _reference(model, inputs, labels, weight):
    """The paper's equations written out: depth k runs on the T - k positions that have a token k
    ahead, h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (the checkpoint's column order),
    h^k = TRM_k(h'), P^k = OutHead(norm(h^k)) predicts t_{i+k+1}; L = L_main + weight / D * sum L_k."""
    seq = inputs.shape[1]
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    emb = model.tok_embeddings(inputs)
    h = emb
    for block in [*model.dense_layers.values(), *model.moe_layers.values()]:
        h = _run_block(block, h, cos, sin)
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1).float(), labels.flatten())
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        n = seq - k
        x = module.eh_proj(torch.cat([module.enorm(emb[:, k : k + n]), module.hnorm(h[:, :n])], dim=-1))
        h = _run_block(module.layers["0"], x, cos[:n], sin[:n])
        logits = model.output(module.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels[:, k : k + n].flatten()))
    total = main + weight / len(losses) * sum(losses)
    return main, torch.stack(losses), total


def test_mtp_targets_shift_by_depth():
    labels = torch.arange(1, 9).view(1, 8)
    assert mtp_targets(labels, 2).tolist() == [[3, 4, 5, 6, 7, 8, IGNORE_INDEX, IGNORE_INDEX]]


def test_mtp_loss_matches_the_papers_equations():
    """(a) Each depth's loss and the gradient of the total equal the hand-written reference."""
    model = _model(depth=2)
    inputs, labels = _batch()
    loss_fn = MTPLoss(fused=False, depth=2, weight=0.3)
    value = loss_fn(model, inputs, labels)
    per_depth = loss_fn.pop_mtp_losses()
    model.pop_aux_loss()
    value.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    main, ref_depths, total = _reference(model, inputs, labels, 0.3)
    total.backward()
    # The logged value is the main loss; each depth's loss and the total's gradient are the reference's.
    torch.testing.assert_close(value, main, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(per_depth, ref_depths, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert loss_fn.pop_mtp_losses() is None  # popped once


def test_mtp_fused_loss_matches_plain():
    model = _model(depth=1)
    inputs, labels = _batch()
    plain, fused = MTPLoss(fused=False, depth=1, weight=0.3), MTPLoss(fused=True, depth=1, weight=0.3)
    torch.testing.assert_close(fused(model, inputs, labels), plain(model, inputs, labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.pop_mtp_losses(), plain.pop_mtp_losses(), rtol=1e-5, atol=1e-5)


def test_mtp_off_leaves_model_and_loss_unchanged():
    """(b) mtp_depth = 0: no new parameter or name, and the task's loss is the plain LM loss; the
    main model of an MTP model computes bit for bit what the model without MTP computes."""
    off, on = _model(depth=0), _model(depth=1)
    assert not hasattr(off, "mtp")
    assert [n for n in on.state_dict() if not n.startswith("mtp.")] == list(off.state_dict())
    on.load_state_dict(off.state_dict(), strict=False)
    inputs, labels = _batch()
    assert torch.equal(on(inputs), off(inputs))
    mtp_loss = MTPLoss(fused=False, depth=1, weight=0.3)
    assert torch.equal(mtp_loss(on, inputs, labels), model_lm_loss(off, inputs, labels, fused=False))
    with torch.no_grad():  # validation: the main loss alone, nothing recorded
        assert torch.equal(mtp_loss(on, inputs, labels), model_lm_loss(off, inputs, labels, fused=False))
    plain = lm_loss_fn(fused=False)
    assert torch.equal(plain(off, inputs, labels), model_lm_loss(off, inputs, labels, fused=False))


def test_mtp_gradient_reaches_the_shared_embedding():
    """(d) The MTP modules use the main model's embedding and head Parameters; a token whose only
    use in the MTP loss is as the embedding of the token k ahead gets a gradient from it."""
    model = _model(depth=1)
    shared = {id(model.tok_embeddings.weight), id(model.output.weight)}
    assert not shared & {id(p) for p in model.mtp.parameters()}
    inputs, labels = _batch()
    last = VOCAB - 1  # only at the last input position: in L_1 only through Emb(t_{i+1}) at i = T - 2
    inputs = torch.where(inputs == last, 0, inputs)
    inputs[:, -1] = last
    hidden = model.mtp_hidden(inputs)
    loss_1 = F.cross_entropy(model.output(hidden[1]).flatten(0, 1), mtp_targets(labels, 1).flatten())
    (grad,) = torch.autograd.grad(loss_1, model.tok_embeddings.weight)
    assert grad[last].abs().sum() > 0


def test_hf_layout_of_the_mtp_layer_both_ways():
    """(4) Module k is HF layer n_layers + k - 1 with enorm, hnorm, eh_proj, shared_head.norm and
    copies of the embedding and head; a model without MTP skips that layer."""
    model = _model(depth=1)
    args = model.args
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    hf = ds_hf.to_hf(sd, args)
    layer = f"model.layers.{args.n_layers}."
    for rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert layer + rest in hf
    assert torch.equal(hf[layer + "embed_tokens.weight"], sd["tok_embeddings.weight"])
    assert torch.equal(hf[layer + "shared_head.head.weight"], sd["output.weight"])
    assert layer + "self_attn.kv_a_proj_with_mqa.weight" in hf and layer + "mlp.gate.weight" in hf
    back = ds_hf.from_hf(hf, args)
    assert sorted(back) == sorted(sd)
    for key in sd:
        assert torch.equal(back[key], sd[key]), key
    without = ds_hf.from_hf(hf, _model(depth=0).args)
    assert not any(k.startswith("mtp.") for k in without)
    cfg = ds_hf.hf_config(args)
    # The depth is the run's: transformers writes num_nextn_predict_layers = 1 without MTP weights.
    assert cfg["num_nextn_predict_layers"] == 1 and ds_hf.args_from_hf_config(cfg) == replace(args, mtp_depth=0)
    assert "num_nextn_predict_layers" not in ds_hf.hf_config(_model(depth=0).args)


def test_keys_checked_and_refused_where_unsupported():
    for bad in (dict(mtp_depth=-1), dict(mtp_loss_weight=-0.1), dict(mtp_loss_weight=math.inf)):
        with pytest.raises(ValueError, match="allowed:"):
            DeepSeekV3Args(**bad)
    for unsupported in (dict(tp_degree=2), dict(cp_degree=2), dict(caller_loss=True)):
        request = StepRequest(mtp_depth=1, model_document_mask=True, **unsupported)
        (message,) = [m for m in refusals(request) if m.startswith("model.mtp_depth")]
        assert message.startswith("model.mtp_depth: 1 ") and "allowed: 0" in message
    assert refusals(StepRequest(mtp_depth=1, mode="compile")) == []
    assert refusals(StepRequest(mtp_depth=1, mode="graph")) == []
    assert refusals(StepRequest(mtp_depth=0, mode="graph", tp_degree=2)) == []
    cfg = build_config(
        "configs/deepseek_v3_debug.toml", [("model.mtp_depth", "1"), ("parallelism.context_parallel_degree", "2")]
    )
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        plan_job(cfg, world_size=2, device_type="cpu")


def test_counts_include_the_mtp_modules():
    """(6) Parameters (and so 6N) count the MTP modules; FLOPs add their attention and the head reuse."""
    with torch.device("meta"):
        model = FAMILY.model_cls(FAMILY.get_args("debugmodel", mtp_depth=2))
    assert model.args.num_params() == sum(p.numel() for p in model.parameters())
    off = FAMILY.get_args("debugmodel")
    assert model.args.num_active_params() > off.num_active_params()
    from planner.deepseek import mla_activation_bytes

    kw = dict(local_batch_size=2, seq_len=64, tp=1, ac_mode="full")
    on_bytes, off_bytes = mla_activation_bytes(model.args, **kw), mla_activation_bytes(off, **kw)
    assert on_bytes.outside > off_bytes.outside and on_bytes.loss == 3 * off_bytes.loss


def test_debug_run_logs_each_depth_and_learns(tmp_path):
    """(c) The debug recipe with mtp_depth = 1 trains in process: the loss and the MTP loss fall and
    metrics.jsonl holds `mtp_loss_1` (the logged `loss` is the main loss)."""
    from tests.support.trainer_runs import train_in_process

    overrides = {
        "model.mtp_depth": "1",
        "model.n_layers": "3",
        "model.attn_backend": "sdpa",
        "training.seq_len": "64",
        "training.local_batch_size": "4",
        "training.steps": "8",
    }
    records = list(train_in_process("configs/deepseek_v3_debug.toml", tmp_path, overrides).values())
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all("mtp_loss_1" in r and "mtp_loss_2" not in r for r in records)
    first, last = records[0], records[-1]
    assert first["loss"] > 8.0 and first["mtp_loss_1"] > 8.0  # ~ ln(4096) at init
    assert last["loss"] < first["loss"] - 0.5 and last["mtp_loss_1"] < first["mtp_loss_1"] - 0.5


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_graph_step_equals_eager_and_returns_each_depth(scan):
    """(d) Graph mode runs the MTP modules inside the captured step (unrolled, and with the main
    stacks scanned; the MTP modules stay outside the scans) and returns each depth's mean loss as
    the eager step does. fp32, 3 AdamW steps of 2 accumulated micro-batches, depth 2: the same math
    in a different op order, so losses and gradient norms agree to fp32 summation noise (1e-5
    relative, the bound of tests/unit/test_graph_step.py) and the weights to 0.2 % of the largest
    update (`param_tolerance`)."""
    from models.deepseek_v3.plan import PLAN
    from parallelisms.simple_fsdp import clip_grad_norm_, data_parallel
    from tests.support.graph_common import build_opt, param_tolerance, snapshot
    from trainer.graph import build_graph_step
    from trainer.step import EagerStep

    def built():
        model = _model(2)
        data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
        return model, build_opt(model)

    (ref, ref_opt), (model, opt) = built(), built()
    before = snapshot(model)
    eager = EagerStep(
        model=ref,
        optimizer=ref_opt,
        max_norm=1.0,
        aux_loss_coef=0.0,
        clip_grad_norm=clip_grad_norm_,
        loss_fn=MTPLoss(fused=False, depth=2, weight=0.3),
    )
    graph = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        backend="aot_eager",
        scan_layers=scan,
        grad_accum_steps=2,
        plan=PLAN,
        loss_fn=MTPLoss(fused=False, depth=2, weight=0.3),
    )
    for step in range(3):
        mbs = [_batch(seed=10 * step + i) for i in range(2)]
        lr = 1e-3 * (step + 1) / 3
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["lr"] = lr
        want, got = eager(mbs, lr), graph(mbs, lr)
        assert got.mtp_losses is not None and got.mtp_losses.shape == (2,)
        for a, b in ((want.loss, got.loss), (want.grad_norm, got.grad_norm)):
            assert abs(float(a) - float(b)) <= 1e-5 * abs(float(a)), (step, float(a), float(b))
        torch.testing.assert_close(got.mtp_losses, want.mtp_losses, rtol=1e-5, atol=0)
    assert graph.capture.num_graphs == 1
    assert bool(graph.stats.scans) == scan
    tol = param_tolerance(before, ref)
    state, ref_state = model.state_dict(), ref.state_dict()
    assert max((state[k].float() - ref_state[k].float()).abs().max().item() for k in state) <= tol
