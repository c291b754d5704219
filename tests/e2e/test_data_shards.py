"""Data per host: each dp rank reads only its data shards, and the global window order does not
depend on the mesh, across a resume on another data-parallel degree (trainer/data/text.py).

A window's identity is a hash of its tokens (seq_len + 1 of them: two different windows of
the bundled corpus or of these files never coincide, asserted by counting distinct ids).
"""

import collections
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import trainer.data.sources
from models.errors import ConfigError
from trainer.data import build_dataloader, merge_states
from trainer.data.tokenizer import build_tokenizer

SEQ, B = 32, 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bundled")


def _ids(inputs, labels) -> list[str]:
    windows = torch.cat([inputs, labels[:, -1:]], dim=1)
    return [hashlib.blake2b(bytes(str(w.tolist()), "ascii"), digest_size=8).hexdigest() for w in windows]


def _loaders(tok, dataset, dp_degree, local_batch_size=B, **kw):
    return [
        build_dataloader(
            dataset=dataset,
            tokenizer=tok,
            seq_len=SEQ,
            local_batch_size=local_batch_size,
            dp_rank=r,
            dp_degree=dp_degree,
            seed=5,
            **kw,
        )
        for r in range(dp_degree)
    ]


def _global_ids(loaders, calls) -> list[str]:
    """The global window order: per call, rank 0's windows, then rank 1's, ..."""
    return [i for _ in range(calls) for loader in loaders for i in _ids(*loader.next_batch())]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """16 jsonl files of 12 documents: with 8 shards, each shard reads 2 whole files."""
    folder = tmp_path_factory.mktemp("files")
    for f in range(16):
        docs = [
            f"file {f} doc {d}: " + " ".join(f"w{(f * 131 + d * 17 + j) % 89}" for j in range(20 + (d * 7) % 30))
            for d in range(12)
        ]
        (folder / f"part-{f:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(folder / "*.jsonl")


def _docs(n: int, words: int = 60) -> list[str]:
    return [f"doc {d}: " + " ".join(f"w{(d * 37 + j) % 97}" for j in range(words)) for d in range(n)]


def _jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """5 documents in one file: fewer than the 64 auto shards (issue 29: refused, then)."""
    return _jsonl(tmp_path_factory.mktemp("few") / "few.jsonl", _docs(5))


CASES = [  # (dataset, dataset_shards, shuffle_block_docs)
    pytest.param("bundled", 0, 8192, id="documents-64-shards"),  # 456 documents dealt to 64 shards
    pytest.param("bundled", 16, 32, id="documents-small-blocks"),  # 2-document shuffle blocks: many blocks
    pytest.param("files", 8, 8, id="files-8-shards"),  # 16 files: whole files per shard
    pytest.param("few", 0, 8192, id="few-documents-auto"),  # 5 documents: auto reads them as one shard
]


@pytest.mark.parametrize("dataset, shards, block_docs", CASES)
def test_resume_4_to_2_ranks_continues_the_global_order(tok, files, few, dataset, shards, block_docs):
    """4 ranks for N calls, checkpoint, 2 ranks for M calls: the windows are exactly those of an
    uninterrupted 4-rank run and of a 1-rank run over the same windows, in the same order: no
    window repeated, none skipped."""
    dataset = {"files": files, "few": few}.get(dataset, dataset)
    kw = dict(num_shards=shards, shuffle_block_docs=block_docs)
    n, m = 7, 30  # 7 x 8 + 30 x 4 = 176 windows: > 1 epoch of every shard in the small cases
    four = _loaders(tok, dataset, 4, **kw)
    before = _global_ids(four, n)
    state = _roundtrip(merge_states([loader.local_state() for loader in four]))
    assert all(entry is not None for entry in state["shards"])
    two = _loaders(tok, dataset, 2, **kw)
    for loader in two:
        loader.load_state_dict(state)
    resumed = before + _global_ids(two, m)

    total = n * 4 * B + m * 2 * B
    uninterrupted = _global_ids(_loaders(tok, dataset, 4, **kw), total // (4 * B))
    single = _global_ids(_loaders(tok, dataset, 1, local_batch_size=8, **kw), total // 8)
    assert len(resumed) == len(uninterrupted) == len(single) == total
    assert resumed == uninterrupted == single  # same order
    assert collections.Counter(resumed) == collections.Counter(single)  # same multiset
    # The windows are distinguishable (no id stands for two windows), so equal lists mean
    # no repeat and no gap; windows do repeat across epochs of a shard, at most once per epoch.
    assert len(set(single)) > total // 2


def test_each_rank_tokenizes_only_its_shards(tok):
    """Bundled corpus (one file, 456 documents, 64 shards): every rank parses all rows but
    tokenizes only its 16 shards' documents. Each shard loads the same blocks whichever rank
    reads it, so the ranks' counts add up to the 1-rank count exactly."""
    single = _loaders(tok, "bundled", 1, local_batch_size=8)[0]
    four = _loaders(tok, "bundled", 4)
    calls = 40  # 320 windows of 33 tokens: a bit over 5 windows per shard, all of block 0
    for _ in range(calls):
        single.next_batch()
        for loader in four:
            loader.next_batch()
    counts = [loader.docs_tokenized for loader in four]
    assert single.docs_tokenized == 456  # one epoch's block: every document once
    assert sum(counts) == single.docs_tokenized
    # 64 shards of 7 or 8 documents (456 = 64 x 7 + 8): 16 shards hold 112 to 128 documents
    assert all(112 <= c <= 128 for c in counts), counts
    assert [len(loader.shards_read()) for loader in four] == [16] * 4
    assert sorted(s for loader in four for s in loader.shards_read()) == list(range(64))


def test_file_shards_open_only_their_files(tok, files, monkeypatch):
    """With >= S files, a rank opens only the files of its shards (f mod S in its shards)."""
    opened = collections.defaultdict(set)
    load = trainer.data.sources._load_streaming
    rank = [0]

    def recording(path, *, local, **kwargs):
        opened[rank[0]].update(os.path.basename(p) for p in kwargs.get("data_files", []))
        return load(path, local=local, **kwargs)

    monkeypatch.setattr(trainer.data.sources, "_load_streaming", recording)
    four = _loaders(tok, files, 4, num_shards=8)
    for _ in range(30):  # > 1 epoch of every shard: every file of the rank's shards is read
        for rank[0], loader in enumerate(four):
            loader.next_batch()
    for r, loader in enumerate(four):
        want = {f"part-{f:02d}.jsonl" for f in range(16) if f % 8 in loader.shards_read()}
        assert opened[r] == want and len(want) == 4, (r, sorted(opened[r]))


def test_small_single_file_is_parsed_once_per_rank(tok, tmp_path, monkeypatch):
    """Fewer files than shards: each rank parses every row, and its shards go through their
    epochs D times as fast as the data's, so rows that fit are stored, not parsed again each
    epoch: 4 ranks x 60 calls (~6 epochs of each shard) open the file once per rank."""
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "x y z " * (5 + i % 7)}) + "\n" for i in range(64)))
    opens = []
    load = trainer.data.sources._load_streaming
    monkeypatch.setattr(trainer.data.sources, "_load_streaming", lambda *a, **k: opens.append(1) or load(*a, **k))
    four = _loaders(tok, str(path), 4, num_shards=8)
    got = _global_ids(four, 60)
    assert len(opens) == 4 and all(min(e[0] for e in loader.local_state()["shards"] if e) >= 4 for loader in four)
    assert got == _global_ids(_loaders(tok, str(path), 1, local_batch_size=8, num_shards=8), 60)


def test_hub_datasets_shard_by_file_like_local_files(tok, files, monkeypatch):
    """A Hub dataset with >= S data files goes through IterableDataset.shard(S, s,
    contiguous=False): here a streaming dataset over the local files stands in for the Hub
    one (offline), and the windows equal those of the same files read as a local glob."""
    import glob

    from trainer.data.sources import Source as _Source
    from trainer.data.text import TokenLoader

    load = trainer.data.sources._load_streaming

    def fake_hub(path, *, local, **kwargs):
        if local:
            return load(path, local=True, **kwargs)
        return load("json", local=True, data_files=sorted(glob.glob(files)), split="train")

    monkeypatch.setattr(trainer.data.sources, "_load_streaming", fake_hub)
    hub = _Source(spec="owner/name", kind="hub", hub_path="owner/name", split="train")
    loaders = [
        TokenLoader(
            source=hub, tokenizer=tok, seq_len=SEQ, local_batch_size=B, dp_rank=r, dp_degree=4, seed=5, num_shards=8
        )
        for r in range(4)
    ]
    assert _global_ids(loaders, 12) == _global_ids(_loaders(tok, files, 4, num_shards=8), 12)
    assert all(loader._by_file for loader in loaders)


def test_dataset_shards_must_fit_the_micro_batch(tok):
    with pytest.raises(ConfigError, match=r"training.dataset_shards: 12 .* multiple of 8"):
        _loaders(tok, "bundled", 4, num_shards=12)
    assert _loaders(tok, "bundled", 4, local_batch_size=32)[0].num_shards == 128  # auto: lcm(64, 128)


def test_resume_with_other_shards_is_config_error(tok):
    loader = _loaders(tok, "bundled", 1, num_shards=16)[0]
    loader.next_batch()
    with pytest.raises(ConfigError, match="training.dataset_shards was 16"):
        _loaders(tok, "bundled", 1)[0].load_state_dict(loader.state_dict())
    partial = _loaders(tok, "bundled", 2)[0].local_state()  # rank 0's shards only
    with pytest.raises(ConfigError, match="no position for data shard"):
        _loaders(tok, "bundled", 1)[0].load_state_dict(partial)


def _small(kind: str, path) -> str:
    """Data sets that trained before data shards and have fewer non-empty documents than 64."""
    if kind == "one-document":  # one long document (~6k tokens)
        return _jsonl(path / "one.jsonl", [" ".join(f"w{j % 97}" for j in range(3000))])
    if kind == "few-documents":
        return _jsonl(path / "few.jsonl", _docs(5))
    if kind == "one-paragraph-txt":  # a .txt file is one document per paragraph: here one
        (path / "book.txt").write_text("A book in one paragraph. " * 400)
        return str(path / "book.txt")
    if kind == "empty-rows-interleaved":  # 128 rows, but every odd row is empty: 32 of 64 shards get no text
        return _jsonl(path / "odd.jsonl", [t if i % 2 == 0 else "" for i, t in enumerate(_docs(128, 10))])
    assert kind == "files-one-empty-shard"  # 64 files, >= S: whole files per shard; file 3 is empty
    for f in range(64):
        _jsonl(path / f"part-{f:02d}.jsonl", [] if f == 3 else _docs(1, 20))
    return str(path / "*.jsonl")


@pytest.mark.parametrize(
    "kind", ["one-document", "few-documents", "one-paragraph-txt", "empty-rows-interleaved", "files-one-empty-shard"]
)
def test_small_data_sets_train_with_the_default_shards(tok, tmp_path, kind):
    """dataset_shards = 0 (the default) on data that would leave an auto shard without text:
    one shard, the same global windows for 1 rank x 8 and 4 ranks x 2 (mesh-independent), and
    the state resumes on 2 ranks in that order."""
    spec = _small(kind, tmp_path)
    single = _loaders(tok, spec, 1, local_batch_size=8)
    four = _loaders(tok, spec, 4)
    assert [loader.num_shards for loader in single + four] == [1] * 5
    calls = 3 if kind == "files-one-empty-shard" else 6  # 64 small files: each epoch opens all of them
    want = _global_ids(single, 2 * calls)
    got = _global_ids(four, calls)
    state = _roundtrip(merge_states([loader.local_state() for loader in four]))
    two = _loaders(tok, spec, 2, local_batch_size=4)
    for loader in two:
        loader.load_state_dict(state)
    assert got + _global_ids(two, calls) == want
    assert len(set(want)) > 1  # windows differ (the ids are not all the same)


def test_data_with_text_in_every_shard_keeps_the_auto_shards(tok, tmp_path, files):
    """Only data that would leave a shard empty is read as one shard: 64 documents (one per
    shard), 16 files of 12 documents (dealt rows), and the bundled corpus keep 64 shards."""
    exact = _jsonl(tmp_path / "64.jsonl", _docs(64, 5))
    for spec in (exact, files, "bundled"):
        assert _loaders(tok, spec, 2, local_batch_size=4)[0].num_shards == 64, spec
    assert _loaders(tok, _jsonl(tmp_path / "63.jsonl", _docs(63, 5)), 1)[0].num_shards == 1


def test_explicit_shards_on_small_data_name_the_way_out(tok, few):
    """An explicit dataset_shards is kept as asked: too many for the data is a ConfigError that
    names the auto value, which reads small data as one shard."""
    with pytest.raises(ConfigError, match=r"no text in split 'train' for data shard 5 of 8 .*dataset_shards = 0"):
        _loaders(tok, few, 1, local_batch_size=8, num_shards=8)[0].next_batch()


@pytest.mark.slow  # two trainer runs, ~15-40 s on the shared 2 cores
def test_trainer_resumes_exactly_on_one_document(tmp_path):
    """The trainer on a one-document data set with the default shards (one shard): a run
    resumed from its step-2 checkpoint trains steps 3-4 with the losses of the uninterrupted
    run, bit for bit (float32, 1 process: the same windows in the same order give the same
    sums)."""
    from tests.support.trainer_runs import read_metrics, run

    data = _small("one-document", tmp_path)
    common = [
        "-m",
        "trainer.train",
        "--config",
        "configs/llama3_debug.toml",
        f"--training.dataset={data}",
        "--training.seq_len=64",
        "--training.local_batch_size=2",
        "--model.n_layers=1",
        "--training.mixed_precision_param=float32",
        "--validation.enable=false",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        "--training.steps=4",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run([sys.executable, *common, f"--job.dump_folder={full}"])
    shutil.copytree(full / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    run([sys.executable, *common, f"--job.dump_folder={resumed}"])
    want, got = read_metrics(full), read_metrics(resumed)
    assert sorted(got) == [3, 4] and sorted(want) == [1, 2, 3, 4]
    assert [got[s]["loss"] for s in (3, 4)] == [want[s]["loss"] for s in (3, 4)]


def _worker(out: str) -> None:
    """torchrun worker: each rank reads 5 calls, then gathers the state over gloo (the trainer's
    path: trainer.runtime.gather_objects) and writes its windows and its state."""
    import torch.distributed as dist

    from trainer.runtime import gather_objects
    from trainer.runtime.device import cpu_backend

    dist.init_process_group(cpu_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build_dataloader(
        dataset="bundled",
        tokenizer=build_tokenizer("bundled"),
        seq_len=SEQ,
        local_batch_size=B,
        dp_rank=rank,
        dp_degree=world,
        seed=5,
        gather=gather_objects(),
    )
    ids = [_ids(*loader.next_batch()) for _ in range(5)]
    state = loader.state_dict()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"ids": ids, "state": state, "docs_tokenized": loader.docs_tokenized}, f)
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow  # 10-25 s on the shared 2 cores (two processes import torch and datasets); the
# trainer's gather also runs in tests/e2e/test_resume_e2e.py (2 ranks save, are killed, resume exactly)
def test_torchrun_ranks_gather_the_state_and_resume_on_other_degrees(tok, tmp_path):
    """2 processes (gloo; 2 rather than 4 keeps it near 10 s on 2 cores; the 4 -> 2 order is
    tested in-process above): every rank's state_dict() is the same complete state, each rank
    tokenized only its half, and the state resumes on 1 rank and on 4 ranks in the global order."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.abspath(__file__),
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    state = ranks[0]["state"]
    assert ranks[1]["state"] == state and None not in state["shards"]
    # 20 windows of 33 tokens touch block 0 of 20 shards: 10 per rank, 7 or 8 documents each
    assert [70 <= r["docs_tokenized"] <= 80 for r in ranks] == [True, True], [r["docs_tokenized"] for r in ranks]
    before = [i for call in range(5) for r in ranks for i in r["ids"][call]]
    want = _global_ids(_loaders(tok, "bundled", 1, local_batch_size=4), 15)
    for dp_degree, local_batch in ((1, 4), (4, 1)):
        loaders = _loaders(tok, "bundled", dp_degree, local_batch_size=local_batch)
        for loader in loaders:
            loader.load_state_dict(state)
        assert before + _global_ids(loaders, 10) == want, dp_degree


if __name__ == "__main__":
    _worker(sys.argv[1])
