"""Document masking (`[training] document_mask`, docs/data.md#document-masking): the loader's
document ids, the model's segment ids and positions, the step plan's rules, and training runs.

The central statement (issue 30, item 3): a packed row with document masking computes, token for
token, what running each document alone computes. Per-token losses are compared on every
position: the last token of a document (its EOS) has the next document's BOS as its label
in the packed row, and the document run alone is given that same label, so no position is
dropped and the summed loss (hence every parameter gradient) must agree too.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import FAMILIES
from models.common.rope import document_positions
from models.errors import ConfigError
from tests.support.corpus import DOCS, small_loader  # the loader fixtures tok, jsonl: tests/unit/conftest.py
from trainer.data.text import document_ids
from trainer.step import StepRequest, plan_step, refusals
from trainer.train import main

EOS = 2  # any id: the model tests below build rows by hand
VOCAB = 512
# Three rows, each a different cut of documents: full documents, a document cut at each edge,
# and one document filling the row. Lengths in tokens (inputs), summing to SEQ per row.
SEQ = 24
LAYOUTS = [[5, 9, 10], [3, 1, 12, 8], [24]]

MODELS = [
    pytest.param("llama3", "debugmodel", id="llama3"),
    pytest.param("qwen3", "debugmodel", id="qwen3"),
    pytest.param("qwen3", "debugmodel_moe", id="qwen3_moe"),
]


def _model(name: str, flavor: str) -> torch.nn.Module:
    family = FAMILIES[name]
    args = family.get_args(flavor, n_layers=2, vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    model = family.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _packed_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, int]]]]:
    """(inputs [rows, SEQ], labels [rows, SEQ], per row the (start, end) of each document).

    Each document's tokens are random ids in [3, VOCAB) ending with EOS (except a document cut by
    the right edge of the row); the label stream is the inputs shifted by one, as the loader
    cuts windows."""
    g = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for layout in LAYOUTS:
        stream = torch.randint(3, VOCAB, (SEQ + 1,), generator=g)
        bounds, start = [], 0
        for length in layout:
            bounds.append((start, start + length))
            start += length
            if start < SEQ:
                stream[start - 1] = EOS  # the document ends with EOS; the next starts after it
        rows.append(stream)
        spans.append(bounds)
    tokens = torch.stack(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), spans


def _per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(labels.shape)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, flavor", MODELS)
@pytest.mark.parametrize("restart", [True, False], ids=["restart", "global"])
def test_packed_row_equals_each_document_alone(name, flavor, restart):
    """Per-token losses and parameter gradients of packed rows with document masking equal
    those of each document run alone: at positions 0..n-1 with `document_positions = restart`,
    and at its offset positions a..b-1 in the row with `global` (RoPE then rotates by the same
    angles as in the row: attention scores depend on position differences only, but the tokens'
    own rotations, hence the rounding, are those of the row).

    Tolerance (fp32): both sides run the same ops on the same values; only reduction orders
    differ: matmuls over a different number of rows may block K differently (<= sqrt(K) u ~
    16 x 6e-8 = 1e-6 relative per product, K = dim 256), and SDPA's softmax sums over a longer
    row whose extra terms are exact zeros (masked: exp(-inf)). Two layers carry that to the
    logits without amplifying it beyond a few 1e-6, so losses (~ln 512 = 6.2) agree within
    1e-5 absolute (1.6e-6 relative). Gradients sum per-token contributions in another order
    (one packed batch against per-document sums): within 5e-6 relative to each tensor's
    largest entry. Measured: losses <= 1.4e-6, gradients <= 1.0e-6 (all six cases). Without
    the mask the packed losses of every document after the first move by > 1e-3 (checked).
    """
    model = _model(name, flavor)
    inputs, labels, spans = _packed_rows()
    segment_ids = torch.from_numpy(document_ids(inputs.numpy(), EOS))
    positions = document_positions(segment_ids) if restart else None

    model.zero_grad(set_to_none=True)
    packed = _per_token_loss(model(inputs, segment_ids=segment_ids, positions=positions), labels)
    packed.sum().backward()
    packed_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    alone = torch.empty_like(packed)
    for row, bounds in enumerate(spans):
        for a, b in bounds:
            doc_positions = None if restart else torch.arange(a, b, dtype=torch.int32)[None]
            loss = _per_token_loss(
                model(inputs[row : row + 1, a:b], positions=doc_positions), labels[row : row + 1, a:b]
            )
            loss.sum().backward()
            alone[row, a:b] = loss.detach()[0]
    alone_grads = _grads(model)

    # The ids the test's rows carry are the ones the spans describe.
    for row, bounds in enumerate(spans):
        for k, (a, b) in enumerate(bounds):
            assert (segment_ids[row, a:b] == k).all()
            if restart:
                assert torch.equal(positions[row, a:b], torch.arange(b - a, dtype=torch.int32))

    torch.testing.assert_close(packed.detach(), alone, rtol=0, atol=1e-5)
    assert packed_grads.keys() == alone_grads.keys()
    for n, g in packed_grads.items():
        scale = max(g.abs().max().item(), alone_grads[n].abs().max().item())
        assert (g - alone_grads[n]).abs().max().item() <= 5e-6 * scale + 1e-12, n

    # The mask is what makes it hold: causal attention over the whole row sees earlier documents.
    with torch.no_grad():
        unmasked = _per_token_loss(model(inputs, positions=positions), labels)
    later = torch.zeros_like(packed, dtype=torch.bool)
    for row, bounds in enumerate(spans):
        for a, b in bounds[1:]:
            later[row, a:b] = True
    assert (unmasked[later] - alone[later]).abs().max() > 1e-3


def test_without_segment_ids_the_model_is_unchanged():
    """segment_ids None and positions None is the plain causal model, bit for bit: one document
    per row with positions 0..s-1 runs the same ops (the block-diagonal mask of a single
    segment is the causal mask; SDPA with an explicit mask may take another kernel, so that
    comparison is to 1e-5, the plain call itself bitwise)."""
    model = _model("llama3", "debugmodel")
    tokens = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens)
        again = model(tokens, segment_ids=None, positions=None)
        one_doc = model(
            tokens,
            segment_ids=torch.zeros(2, SEQ, dtype=torch.int32),
            positions=torch.arange(SEQ, dtype=torch.int32).expand(2, SEQ),
        )
    assert torch.equal(plain, again)
    torch.testing.assert_close(one_doc, plain, rtol=0, atol=1e-5)


def test_document_positions():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    want = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    assert torch.equal(document_positions(seg), want)


# ------------------------------------------------------------------------------- the loader


def _loader(tok, dataset, **kw):
    return small_loader(tok, dataset, **{"document_ids": True, **kw})


def _check_ids(inputs: torch.Tensor, ids: torch.Tensor, tok) -> tuple[int, int]:
    """Check ids against the documents read off the tokens: every document is [BOS] text [EOS],
    so inside a row a new id starts exactly at each BOS after the first position, an id never
    holds BOS past its first token nor EOS before its last, and ids count 0, 1, 2... per row.
    Returns (rows whose first token is not BOS: a document cut by the left edge; rows whose last
    token is not EOS: cut by the right edge)."""
    assert ids.dtype == torch.int32 and ids.shape == inputs.shape
    cut_left = cut_right = 0
    for row, row_ids in zip(inputs.tolist(), ids.tolist()):
        assert row_ids[0] == 0
        for i in range(1, len(row)):
            new_doc = row[i] == tok.bos_id
            assert row_ids[i] == row_ids[i - 1] + (1 if new_doc else 0), (row, row_ids, i)
        for i, t in enumerate(row[:-1]):
            if t == tok.eos_id:
                assert row_ids[i + 1] == row_ids[i] + 1
        cut_left += row[0] != tok.bos_id
        cut_right += row[-1] != tok.eos_id
    return cut_left, cut_right


def test_loader_ids_mark_documents_and_window_edges(tok, jsonl):
    loader = _loader(tok, jsonl)
    cut_left = cut_right = multi = 0
    for _ in range(12):  # 48 windows of 16 tokens: past one epoch of the 24 documents
        inputs, labels, ids = loader.next_batch()
        left, right = _check_ids(inputs, ids, tok)
        cut_left, cut_right = cut_left + left, cut_right + right
        multi += int((ids.max(dim=1).values > 0).sum())
    # The data exercises what the ids must get right: documents cut by both edges, rows with several.
    assert cut_left > 0 and cut_right > 0 and multi > 0


def test_loader_off_by_default_and_the_same_windows(tok, jsonl):
    plain = _loader(tok, jsonl, document_ids=False)
    masked = _loader(tok, jsonl)
    for _ in range(4):
        a, b = plain.next_batch(), masked.next_batch()
        assert len(a) == 2 and len(b) == 3
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert plain.state_dict() == masked.state_dict()


def test_resumed_loader_yields_the_same_ids(tok, jsonl):
    first = _loader(tok, jsonl)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    want = [first.next_batch() for _ in range(4)]
    resumed = _loader(tok, jsonl)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    got = [resumed.next_batch() for _ in range(4)]
    for w, g in zip(want, got):
        assert len(g) == 3 and all(torch.equal(x, y) for x, y in zip(w, g))


def test_rank_slices_carry_the_single_rank_ids(tok, jsonl):
    """Sharding by data-parallel rank: the rows (and their ids) of 2 ranks x 2 rows are those of
    one rank x 4 rows, as for the tokens (tests/unit/test_data.py)."""
    whole = _loader(tok, jsonl)
    ranks = [_loader(tok, jsonl, local_batch_size=2, dp_rank=r, dp_degree=2) for r in (0, 1)]
    for _ in range(5):
        w = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        for k in range(3):
            assert torch.equal(torch.cat([p[k] for p in parts]), w[k])


def test_document_ids_function():
    eos = 9
    inputs = np.array([[1, 5, 9, 1, 6, 9, 1, 7], [4, 4, 9, 9, 1, 2, 3, 9]])
    want = [[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 2, 2, 2, 2]]
    got = document_ids(inputs, eos)
    assert got.dtype == np.int32 and got.tolist() == want


# ---------------------------------------------------------------------------- rules and runs


@pytest.fixture
def _cwd(monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


TINY = [
    "--config",
    "configs/llama3_debug.toml",
    "--model.n_layers=2",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--validation.enable=false",
    "--checkpoint.enable=false",
    "--training.mixed_precision_param=float32",
    "--model.attn_backend=sdpa",
    "--training.steps=3",
]


def _losses(folder) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f)]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith("step ")]


def test_training_runs_with_document_mask_eager_and_graph(tmp_path, _cwd):
    """The debug recipe trains with document masking in eager mode, as one captured graph with
    layer scan and activation checkpointing (backend aot_eager: the captured ops run one by one),
    and with the fused loss and a validation pass. fp32: the graph step computes the eager math (tests/unit/test_graph_step.py: losses
    within 1e-5 relative), so the two runs' losses agree to 1e-5; both differ from the run
    without masking (the data set's short documents put several in each 64-token window; the
    bundled corpus's median document has 680 tokens, too long to show it in three steps)."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    runs = {
        "plain": [],
        "eager": ["--training.document_mask=true", "--training.document_positions=restart"],
        "graph": [
            "--training.document_mask=true",
            "--training.document_positions=restart",
            "--compile.mode=graph",
            "--compile.backend=eager",
            "--compile.scan_layers=true",
            "--activation_checkpoint.mode=full",
        ],
        # The fused loss starts from model.hidden(inputs, segment_ids, positions); validation
        # reads the same batch layout.
        "fused": [
            "--training.document_mask=true",
            "--training.document_positions=restart",
            "--training.fused_loss=on",
            "--validation.enable=true",
            f"--validation.dataset={data}",
            "--validation.freq=3",
            "--validation.steps=1",
        ],
    }
    losses = {}
    for name, extra in runs.items():
        assert main([*TINY, f"--job.dump_folder={tmp_path / name}", f"--training.dataset={data}", *extra]) == 0
        losses[name] = _losses(tmp_path / name)
    assert len(losses["eager"]) == 3 and all(np.isfinite(losses["eager"]))
    assert losses["graph"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["fused"] == pytest.approx(losses["eager"], rel=1e-5)  # as tests/e2e/test_train_e2e.py
    with open(tmp_path / "fused" / "metrics.jsonl") as f:
        val = [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]
    assert len(val) == 1 and np.isfinite(val).all()
    assert abs(losses["eager"][0] - losses["plain"][0]) > 1e-4


@pytest.mark.slow
def test_qwen3_moe_graph_scan_matches_eager_with_document_mask(tmp_path, _cwd):
    """Qwen 3 MoE (debug recipe, 2 layers) with document masking and restart positions: the
    captured graph with layer scan (aot_eager) trains like eager; fp32, losses within 1e-5
    relative as above (measured: equal bit for bit). ~15 s on an idle core, minutes under load."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    argv = [
        "--config",
        "configs/qwen3_moe_debug.toml",
        *TINY[2:],
        f"--training.dataset={data}",
        "--training.document_mask=true",
        "--training.document_positions=restart",
    ]
    graph = ["--compile.mode=graph", "--compile.backend=eager", "--compile.scan_layers=true"]
    assert main([*argv, f"--job.dump_folder={tmp_path / 'eager'}"]) == 0
    assert main([*argv, *graph, f"--job.dump_folder={tmp_path / 'graph'}"]) == 0
    eager, captured = _losses(tmp_path / "eager"), _losses(tmp_path / "graph")
    assert len(eager) == 3 and captured == pytest.approx(eager, rel=1e-5)


BAD = {
    "positions": (["--training.document_positions=begin"], "training.document_positions: 'begin'"),
    "mask": (["--training.document_mask=maybe"], "training.document_mask"),
    "restart_without_mask": (["--training.document_positions=restart"], "training.document_positions: restart needs"),
    "flux": (
        ["--config", "configs/flux_debug.toml", "--training.document_mask=true"],
        "training.document_mask: true applies to packed token windows (task lm)",
    ),
    "hf": (
        ["--model.name=hf", "--model.flavor=config", "--model.hf_config={hf}", "--training.document_mask=true"],
        "training.document_mask: true needs a model that takes segment ids",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_exit_2_with_one_error_line(tmp_path, _cwd, capsys, case):
    """Each is refused before anything is built: exit 2, one `error:` line naming the key and what
    is allowed, no traceback (the flux and hf cases: families that do not take segment ids)."""
    from tests.support.hf_configs import write_config

    extra, needle = BAD[case]
    extra = [a.format(hf=write_config(str(tmp_path), "llama")) for a in extra]
    argv = (
        extra + [f"--job.dump_folder={tmp_path / 'run'}"]
        if extra[0] == "--config"
        else [*TINY, f"--job.dump_folder={tmp_path / 'run'}", *extra]
    )
    rc = main(argv)
    lines = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (rc, lines)
    assert "Traceback" not in "\n".join(lines) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rules_refuse_models_without_segment_ids():
    """The hf backend (and any family that does not declare `document_mask`) is refused before
    anything is built; llama3/qwen3 pass, and the plan records the batch layout."""
    base = dict(document_mask=True, task="lm")
    assert refusals(StepRequest(**base, model_document_mask=True)) == []
    msgs = refusals(StepRequest(**base, model_document_mask=False))
    assert len(msgs) == 1 and msgs[0].startswith("training.document_mask: true needs a model that takes segment ids")
    assert not FAMILIES["hf"].document_mask and FAMILIES["llama3"].document_mask and FAMILIES["qwen3"].document_mask
    msgs = refusals(StepRequest(**base, model_document_mask=True, caller_loss=True))
    assert any(m.startswith("training.document_mask") for m in msgs)
    with pytest.raises(ConfigError, match="document_positions"):
        plan_step(document_positions="restart")
    plan = plan_step(**base, model_document_mask=True, document_positions="restart")
    assert plan.document_mask and plan.restart_positions
    plan = plan_step(**base, model_document_mask=True)
    assert plan.document_mask and not plan.restart_positions


# ----------------------------------------------------------------- tensor parallel (2 ranks)


def _tp_rank(state, inputs, labels, segment_ids, positions):
    """Per-token losses and full gradients of the TP=2 (sequence-parallel) Llama 3 on one rank."""
    import torch.distributed as dist

    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from tests.support.parallel_harness import LLAMA3_PLAN, Llama3, full, llama3_args, load_full_state

    dims = ParallelDims(world_size=dist.get_world_size(), dp_shard=1, tp=2)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Llama3(llama3_args())
    parallelize_model(
        model, plan=LLAMA3_PLAN, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_full_state(model, state)
    logits = full(model(inputs, segment_ids=segment_ids, positions=positions))
    loss = _per_token_loss(logits, labels)
    loss.sum().backward()
    return loss.detach(), {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
def test_tensor_parallel_passes_segment_ids():
    """TP=2 with sequence parallelism (2 gloo processes): the attention modules get the segment
    ids and per-token positions next to their all-gathered input, and compute what one process
    computes. fp32; TP splits the heads (attention per head is unchanged) and the rowwise
    projections sum two partial products (one extra rounding, ~u relative): per-token losses
    within 1e-5 absolute and gradients within 5e-6 of each tensor's largest entry, as above."""
    from tests.support.parallel_harness import SEQ_LEN, Llama3, llama3_args, reference_state, run_processes

    state = reference_state("llama3", seed=3)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 4096, (2, SEQ_LEN + 1), generator=g)
    tokens[0, [4, 9]] = EOS
    tokens[1, [6]] = EOS
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    segment_ids = torch.from_numpy(document_ids(inputs.numpy(), EOS))
    positions = document_positions(segment_ids)
    assert segment_ids.max() == 2

    model = Llama3(llama3_args())
    model.load_state_dict(state, strict=False)
    ref = _per_token_loss(model(inputs, segment_ids=segment_ids, positions=positions), labels)
    ref.sum().backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}

    for loss, grads in run_processes(2, _tp_rank, state, inputs, labels, segment_ids, positions):
        torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-5)
        for n, grad in grads.items():
            scale = ref_grads[n].abs().max().item()
            assert (grad - ref_grads[n]).abs().max().item() <= 5e-6 * scale + 1e-12, n
