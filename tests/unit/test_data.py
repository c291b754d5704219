"""Data loader: packing, the mesh-independent global batch, resume, epochs, inputs, errors."""

import gzip
import io
import json
import socket
import warnings

import pytest
import torch

from models.errors import ConfigError
from tests.support.corpus import DOCS, SHARDS, small_loader
from trainer.data import BUNDLED_CORPUS_DIR, merge_states, resolve_dataset


def _loader(tok, dataset, **kw):
    return small_loader(tok, dataset, **kw)


def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def _windows(batches):
    """Rebuild the token windows ([B, T+1] each) from (inputs, labels) pairs."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])


def _docs_in(stream, tok):
    """Split a token stream into documents on BOS ... EOS."""
    text = tok.decode(stream)
    return [d.removesuffix("<|end_of_text|>") for d in text.split("<|begin_of_text|>")[1:]]


def test_packing_in_order(tok, jsonl):
    # Validation reads in file order: the windows are the plain concatenation, cut every T+1.
    loader = _loader(tok, jsonl, split="validation")
    expected = torch.tensor([t for d in DOCS for t in tok.encode(d, bos=True, eos=True)])
    batches = list(loader)
    window = 17
    num_windows = len(expected) // window // 4 * 4  # full micro-batches only
    assert len(batches) == num_windows // 4
    assert torch.equal(_windows(batches).flatten(), expected[: num_windows * window])
    for x, y in batches:
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
    # Every EOS is followed by the next document's BOS.
    flat = expected.tolist()
    assert all(flat[i + 1] == tok.bos_id for i, t in enumerate(flat[:-1]) if t == tok.eos_id)


def _shard_streams(windows, num_shards):
    """Global windows [N, T+1] -> each shard's token stream (global window g is shard g mod S's)."""
    return [windows[s::num_shards].flatten().tolist() for s in range(num_shards)]


def test_shuffled_epochs_hold_every_document_once(tok, jsonl):
    # Row i belongs to shard i mod S; each shard's stream holds its documents once per epoch,
    # permuted differently per epoch.
    per_epoch = [sum(len(tok.encode(d, bos=True, eos=True)) for d in DOCS[s::SHARDS]) for s in range(SHARDS)]
    loader = _loader(tok, jsonl)
    calls = 2 * max(per_epoch) * SHARDS // (4 * 17) + SHARDS
    streams = _shard_streams(_windows(_batches(loader, calls)), SHARDS)
    orders = []
    for s in range(SHARDS):
        epoch0, epoch1 = streams[s][: per_epoch[s]], streams[s][per_epoch[s] : 2 * per_epoch[s]]
        assert sorted(_docs_in(epoch0, tok)) == sorted(DOCS[s::SHARDS])
        assert sorted(_docs_in(epoch1, tok)) == sorted(DOCS[s::SHARDS])
        orders.append((_docs_in(epoch0, tok), _docs_in(epoch1, tok)))
    assert any(e0 != DOCS[s::SHARDS] for s, (e0, _) in enumerate(orders))  # shuffled...
    assert any(e0 != e1 for e0, e1 in orders)  # ...differently per epoch
    assert min(entry[0] for entry in loader.state_dict()["shards"]) >= 2  # every shard is in epoch >= 2


def test_block_shuffle_keeps_blocks(tok, jsonl):
    # 2 shards, shuffle blocks of 10 rows: each shard permutes blocks of 5 of its documents,
    # and each block's documents stay within that block's span.
    loader = _loader(tok, jsonl, shuffle_block_docs=10, num_shards=2, local_batch_size=2)
    per_epoch = sum(len(tok.encode(d, bos=True, eos=True)) for d in DOCS)
    for s, stream in enumerate(_shard_streams(_windows(_batches(loader, per_epoch // (2 * 17))), 2)):
        docs, mine = _docs_in(stream, tok), DOCS[s::2]
        assert sorted(docs[:5]) == sorted(mine[:5]) and sorted(docs[5:10]) == sorted(mine[5:10])
        assert docs[:10] != mine[:10]


def test_seed_determinism(tok, jsonl):
    a = _windows(_batches(_loader(tok, jsonl, seed=3), 5))
    b = _windows(_batches(_loader(tok, jsonl, seed=3), 5))
    c = _windows(_batches(_loader(tok, jsonl, seed=4), 5))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("dp_degree", [2, 4])
def test_rank_slices_concatenate_to_the_single_rank_batch(tok, jsonl, dp_degree):
    single = _batches(_loader(tok, jsonl, local_batch_size=8), 12)
    ranks = [
        _batches(_loader(tok, jsonl, local_batch_size=8 // dp_degree, dp_rank=r, dp_degree=dp_degree), 12)
        for r in range(dp_degree)
    ]
    for call, (x, y) in enumerate(single):
        assert torch.equal(torch.cat([ranks[r][call][0] for r in range(dp_degree)]), x)
        assert torch.equal(torch.cat([ranks[r][call][1] for r in range(dp_degree)]), y)


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # weights_only: plain types only, as DCP wants


@pytest.mark.parametrize("block_docs", [8192, 5])
def test_resume_is_exact_across_epochs_and_blocks(tok, jsonl, block_docs):
    full = _batches(_loader(tok, jsonl, shuffle_block_docs=block_docs), 30)
    for k in (1, 7, 13, 22):
        first = _loader(tok, jsonl, shuffle_block_docs=block_docs)
        _batches(first, k)
        resumed = _loader(tok, jsonl, shuffle_block_docs=block_docs, seed=7)
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        rest = _batches(resumed, 30 - k)
        assert torch.equal(_windows(rest), _windows(full[k:])), k


def test_resume_with_another_dp_degree(tok, jsonl):
    full = _batches(_loader(tok, jsonl, local_batch_size=8), 20)
    # 2 ranks x 4 for 9 calls, then resume on 1 rank x 8 and on 4 ranks x 2.
    two = [_loader(tok, jsonl, local_batch_size=4, dp_rank=r, dp_degree=2) for r in range(2)]
    for loader in two:
        _batches(loader, 9)
    # Each rank holds the positions of its own shards; together they are the whole state.
    local = [loader.local_state() for loader in two]
    assert all((entry is None) != (s % 8 < 4) for s, entry in enumerate(local[0]["shards"]))
    state = _roundtrip(merge_states(local))
    one = _loader(tok, jsonl, local_batch_size=8)
    one.load_state_dict(state)
    assert torch.equal(_windows(_batches(one, 11)), _windows(full[9:]))
    four = [_loader(tok, jsonl, local_batch_size=2, dp_rank=r, dp_degree=4) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    got = [_batches(loader, 11) for loader in four]
    for call in range(11):
        assert torch.equal(torch.cat([got[r][call][0] for r in range(4)]), full[9 + call][0])


def test_state_dict_survives_dcp(tok, jsonl, tmp_path):
    import torch.distributed.checkpoint as dcp

    loader = _loader(tok, jsonl)
    _batches(loader, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save({"data": loader.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
        fresh = _loader(tok, jsonl)
        target = {"data": fresh.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(target["data"])
    assert torch.equal(_windows(_batches(fresh, 3)), _windows(_batches(loader, 3)))


def test_state_mismatch_is_config_error(tok, jsonl):
    loader = _loader(tok, jsonl)
    loader.next_batch()
    with pytest.raises(ConfigError, match="seq_len"):
        _loader(tok, jsonl, seq_len=32).load_state_dict(loader.state_dict())


def test_validation_restarts_from_the_start(tok, jsonl):
    loader = _loader(tok, jsonl, split="validation")
    first = list(loader)
    assert first and list(loader) == []  # used up
    loader.reset()
    assert torch.equal(_windows(list(loader)), _windows(first))


def _write(path, kind, docs):
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif kind == "json":
        path.write_text(json.dumps([{"text": d} for d in docs]))
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), str(path))
    elif kind == "txt":
        path.write_text("\n\n".join(docs) + "\n")


@pytest.mark.parametrize("kind", ["jsonl", "json", "jsonl.gz", "parquet", "txt"])
def test_local_formats(tok, tmp_path, kind):
    path = tmp_path / f"data.{kind}"
    _write(path, kind, DOCS[:10])
    stream = _windows(list(_loader(tok, str(path), split="validation", seq_len=8, local_batch_size=1)))
    expected = [t for d in DOCS[:10] for t in tok.encode(d, bos=True, eos=True)]
    assert stream.flatten().tolist() == expected[: stream.numel()]
    assert stream.numel() > len(expected) - 9


def test_glob_and_folder_read_files_in_sorted_order(tok, tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "b.jsonl", "jsonl", DOCS[5:10])
    _write(tmp_path / "a.jsonl", "jsonl", DOCS[:5])
    expected = [t for d in DOCS[:10] for t in tok.encode(d, bos=True, eos=True)]
    for spec in (str(tmp_path / "**" / "*.jsonl"), str(tmp_path)):
        got = _windows(list(_loader(tok, spec, split="validation", seq_len=8, local_batch_size=1)))
        assert got.flatten().tolist() == expected[: got.numel()]


def test_other_text_field(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS[:4]))
    x, _ = _loader(tok, str(path), text_field="content", split="validation", local_batch_size=1).next_batch()
    assert x[0].tolist() == [t for d in DOCS[:4] for t in tok.encode(d, bos=True, eos=True)][:16]


def test_local_data_never_touches_the_network(tok, jsonl, monkeypatch):
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled by the test")

    # Name resolution comes first in every client, so catching it catches any attempt.
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    _batches(_loader(tok, jsonl), 20)  # several epochs, so several file opens
    train = _loader(tok, "bundled", seq_len=64, local_batch_size=2)
    x, y = train.next_batch()
    assert x.shape == (2, 64) and int(x.max()) < tok.n_vocab
    val = _loader(tok, "bundled", split="validation", seq_len=64, local_batch_size=2)
    assert torch.equal(
        val.next_batch()[0], _loader(tok, "bundled", split="validation", seq_len=64, local_batch_size=2).next_batch()[0]
    )
    assert not torch.equal(val.next_batch()[0], x)
    assert attempts == []  # datasets swallows connection errors, so count the attempts


def test_bundled_corpus_is_reproducible(tmp_path):
    """scripts/data/build_corpus.py on the same standard library gives the shipped files."""
    from scripts.data import build_corpus

    build_corpus.main(["--out", str(tmp_path)])
    with open(f"{BUNDLED_CORPUS_DIR}/manifest.json") as f:
        shipped = json.load(f)
    rebuilt = json.loads((tmp_path / "manifest.json").read_text())
    if rebuilt["stdlib_fingerprint"] != shipped["stdlib_fingerprint"]:
        pytest.skip(f"this standard library differs from the one used (Python {shipped['python_version']})")
    assert rebuilt == shipped
    for split in ("train", "validation"):
        with open(f"{BUNDLED_CORPUS_DIR}/{split}.jsonl.gz", "rb") as f:
            assert (tmp_path / f"{split}.jsonl.gz").read_bytes() == f.read()


def test_hub_spec_parsing():
    src = resolve_dataset("allenai/c4:en", "validation")
    assert (src.kind, src.hub_path, src.hub_config, src.split) == ("hub", "allenai/c4", "en", "validation")
    assert resolve_dataset("wikitext").hub_config is None


def _file(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda p: str(p / "nothing-*.jsonl"), "matches no file"),
        (lambda p: str(p / "missing.jsonl"), "no such file"),
        (lambda p: "./relative/missing", "no such file"),
        (lambda p: _file(p / "e.jsonl", ""), "no text"),
        (lambda p: _file(p / "b.jsonl", '{"text": ""}\n{"text": null}\n'), "no text"),
        (lambda p: _file(p / "u.jsonl", b'{"text": "caf\xe9"}\n'), "UTF-8"),
        (lambda p: _file(p / "u.txt", b"ok\n\nbad \xff\xfe\n"), "UTF-8"),
        (lambda p: _file(p / "f.jsonl", '{"body": "x"}\n'), "no field 'text'"),
        (lambda p: _file(p / "i.jsonl", '{"text": 3}\n'), "holds int"),
        (lambda p: _file(p / "z.jsonl.gz", b"not gzip at all"), "cannot read file"),
        (lambda p: _file(p / "j.jsonl", '{"text": "a"\n'), "line 1 is not valid JSON"),
        (lambda p: _file(p / "c.csv", "text\nx\n") and str(p / "*.csv"), "unsupported type"),
        (lambda p: _file(p / "m.jsonl", "{}\n") and _file(p / "m.txt", "x") and str(p / "m.*"), "mixes"),
        (lambda p: "bundled", None),
    ],
)
def test_bad_inputs_raise_config_error(tok, tmp_path, make, needle):
    spec = make(tmp_path)
    if needle is None:  # the bundled corpus has no "test" split
        with pytest.raises(ConfigError, match="split"):
            _loader(tok, spec, split="test")
        return
    with pytest.raises(ConfigError) as err:
        _loader(tok, spec).next_batch()
    assert needle in str(err.value)
    if spec.startswith(str(tmp_path)) and "*" not in spec:
        assert spec in str(err.value)  # names the file


def test_validation_smaller_than_a_batch(tok, tmp_path):
    path = tmp_path / "small.jsonl"
    _write(path, "jsonl", DOCS[:1])
    with pytest.raises(ConfigError, match="fewer tokens than one micro-batch"):
        _loader(tok, str(path), split="validation", seq_len=512).next_batch()
    # Training repeats the small document until a window is full.
    x, _ = _loader(tok, str(path), seq_len=512, num_shards=1, local_batch_size=1).next_batch()
    assert int((x == tok.bos_id).sum()) > 1


def test_bad_json_line_past_the_first_chunk_names_the_true_line(tmp_path, capfd):
    # The json reader parses ~10 MB chunks and numbered its error rows from the chunk start
    # ("in row 9709" for line 111945), and logged a second stderr line of its own.
    import json

    from trainer.data.sources import iter_texts as _iter_texts

    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        line = 0
        while f.tell() < 11 * 1024 * 1024:
            f.write(json.dumps({"text": f"document {line} " * 8}) + "\n")
            line += 1
            if line % 1000 == 0:  # blank lines are not rows: line and row numbers drift apart
                f.write("\n")
                line += 1
        f.write('{"text": "cut short\n')
        bad = line + 1
        f.write(json.dumps({"text": "after"}) + "\n")
    capfd.readouterr()
    with pytest.raises(ConfigError) as err:
        for _ in _iter_texts(resolve_dataset(str(path)), "text"):
            pass
    message = str(err.value)
    assert f"file {path} line {bad} is not valid JSON" in message and "\n" not in message, message
    assert capfd.readouterr().err == ""


def test_validation_check_reads_what_validation_reads(tok, tmp_path):
    docs = tmp_path / "docs.jsonl"
    _write(docs, "jsonl", DOCS)
    loader = _loader(tok, str(docs), split="validation", seq_len=16)
    first = loader.next_batch()
    loader.reset()
    assert loader.check(3) == 3
    torch.testing.assert_close(loader.next_batch(), first)  # starts over afterwards
    nofield = _file(tmp_path / "v.jsonl", '{"body": "x"}\n')
    with pytest.raises(ConfigError, match="no field 'text'"):
        _loader(tok, nofield, split="validation").check(4)
    small = tmp_path / "small.jsonl"
    _write(small, "jsonl", DOCS[:1])
    with pytest.raises(ConfigError, match="fewer tokens than one micro-batch"):
        _loader(tok, str(small), split="validation", seq_len=512).check(4)
