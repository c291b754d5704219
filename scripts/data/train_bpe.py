"""Train the bundled byte-level BPE on the bundled corpus and write it as tiktoken ranks.

Uses the Hugging Face `tokenizers` library (a dev-only dependency; the product reads the
result with tiktoken): the Llama 3 / cl100k regex split, then byte-level mapping, then a BPE
trainer with the 256 byte symbols as the initial alphabet. The trained merges are converted
to tiktoken ranks: single bytes get ranks 0..255 (rank = byte value), merged tokens get
256.. in the order the trainer created them, which is their merge priority. 4094 ranks plus
the 2 special tokens the runtime adds (`<|begin_of_text|>`, `<|end_of_text|>`) give 4096.

    .venv/bin/python scripts/data/train_bpe.py     # reads assets/corpus/train.jsonl.gz
                                              # writes assets/tokenizer/titan_bpe_4k.tiktoken

It then checks the file with the runtime tokenizer: exact round trip on the validation split
and the share of documents whose ids equal the HF tokenizer's (mapped to tiktoken ranks).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import sys
import time

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from trainer.data.tokenizer import (
    BUNDLED_SPECIAL_TOKENS,
    LLAMA3_PATTERN,
    load_bpe_ranks,
)
from trainer.data.tokenizer import Tokenizer as TiktokenTokenizer
from trainer.runtime import cli

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level table: printable bytes map to themselves, the other bytes to
    code points from 256 up, in byte order (what `ByteLevel` uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_texts(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train(texts: list[str], num_ranks: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def to_tiktoken_ranks(tok: Tokenizer) -> dict[bytes, int]:
    """Byte-level vocab -> {token_bytes: rank} with bytes first, then merges in HF id order."""
    decode = {ch: b for b, ch in byte_to_unicode().items()}
    vocab = tok.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in by_id:
        token_bytes = bytes(decode[ch] for ch in token)
        if token_bytes not in ranks:
            ranks[token_bytes] = len(ranks)
    return ranks


def hf_ids_as_ranks(tok: Tokenizer, ranks: dict[bytes, int]) -> dict[int, int]:
    decode = {ch: b for b, ch in byte_to_unicode().items()}
    return {i: ranks[bytes(decode[ch] for ch in token)] for token, i in tok.get_vocab().items()}


def write_ranks(path: str, ranks: dict[bytes, int]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=os.path.join(_ROOT, "assets", "corpus"))
    parser.add_argument("--out", default=os.path.join(_ROOT, "assets", "tokenizer", "titan_bpe_4k.tiktoken"))
    parser.add_argument("--n-vocab", type=int, default=4096, help="total ids including the 2 special tokens")
    args = parser.parse_args(argv)

    num_ranks = args.n_vocab - len(BUNDLED_SPECIAL_TOKENS)
    texts = read_texts(os.path.join(args.corpus, "train.jsonl.gz"))
    t0 = time.perf_counter()
    hf = train(texts, num_ranks)
    train_s = time.perf_counter() - t0
    ranks = to_tiktoken_ranks(hf)
    if len(ranks) != num_ranks:
        raise SystemExit(f"trainer produced {len(ranks)} ranks, expected {num_ranks}")
    write_ranks(args.out, ranks)

    # Check what the runtime will load, read back from disk.
    rt = TiktokenTokenizer(name="check", ranks=load_bpe_ranks(args.out), special_tokens=BUNDLED_SPECIAL_TOKENS)
    assert rt.n_vocab == args.n_vocab, rt.n_vocab
    val = read_texts(os.path.join(args.corpus, "validation.jsonl.gz"))
    id_map = hf_ids_as_ranks(hf, ranks)
    same = 0
    num_tokens = 0
    for text in val:
        ids = rt.encode(text, bos=False, eos=False)
        assert rt.decode(ids) == text, "round trip failed"
        num_tokens += len(ids)
        same += ids == [id_map[i] for i in hf.encode(text).ids]
    report = {
        "file": os.path.relpath(args.out, _ROOT),
        "n_vocab": rt.n_vocab,
        "ranks": len(ranks),
        "train_docs": len(texts),
        "train_seconds": round(train_s, 2),
        "validation_chars_per_token": round(sum(map(len, val)) / num_tokens, 3),
        "validation_docs_identical_to_hf": f"{same}/{len(val)}",
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(cli.run(main))
