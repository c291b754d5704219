"""Tokenizer: bundled BPE, Llama 3 file layout, round trips, and bad files."""

import base64
import os

import pytest

from models.errors import ConfigError
from trainer.data.tokenizer import BUNDLED_BPE_PATH, LLAMA3_SPECIAL_TOKENS, build_tokenizer, load_bpe_ranks

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve façade, Ångström, Straße, ĳ, Ελληνικά, Русский",
    "emoji: 😀🚀👩‍👩‍👧 and flags 🇫🇷",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\n    indented  \r\n",
    "日本語のテキスト、中文文本。",
    "",
    "   ",
    "<|begin_of_text|> looks special but is text",
]


def _write_ranks(path, tokens):
    with open(path, "wb") as f:
        for rank, tok in enumerate(tokens):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")


@pytest.fixture(scope="module")
def bundled():
    return build_tokenizer("bundled")


def test_bundled_vocab(bundled):
    assert bundled.n_vocab == 4096
    assert len(load_bpe_ranks(BUNDLED_BPE_PATH)) == 4094
    assert (bundled.bos_id, bundled.eos_id) == (4094, 4095)
    assert bundled.special_tokens == {"<|begin_of_text|>": 4094, "<|end_of_text|>": 4095}


@pytest.mark.parametrize("text", TEXTS)
def test_bundled_round_trip(bundled, text):
    ids = bundled.encode(text, bos=False, eos=False)
    assert all(0 <= i < 4094 for i in ids)
    assert bundled.decode(ids) == text


def test_bos_eos_and_specials_in_text(bundled):
    plain = bundled.encode("some text", bos=False, eos=False)
    assert bundled.encode("some text", bos=True, eos=True) == [bundled.bos_id] + plain + [bundled.eos_id]
    assert bundled.encode("some text", bos=True, eos=False) == [bundled.bos_id] + plain
    # A special token's name inside data is plain text, never the control id.
    ids = bundled.encode("<|end_of_text|>", bos=False, eos=False)
    assert bundled.eos_id not in ids and len(ids) > 1
    assert bundled.decode([bundled.bos_id]) == "<|begin_of_text|>"


def test_bundled_compresses_english(bundled):
    text = "Return a new list containing all items from the iterable in ascending order."
    # A trained 4k BPE needs far fewer tokens than bytes on this corpus' kind of English.
    assert len(bundled.encode(text, bos=False, eos=False)) < len(text.encode()) / 3


def test_encode_batch_matches_encode(bundled):
    batch = bundled.encode_batch(TEXTS, bos=True, eos=True)
    assert batch == [bundled.encode(t, bos=True, eos=True) for t in TEXTS]


def test_bundled_path_is_bundled(bundled):
    by_path = build_tokenizer(BUNDLED_BPE_PATH)
    assert by_path.n_vocab == 4096
    assert by_path.encode(TEXTS[0], bos=True, eos=True) == bundled.encode(TEXTS[0], bos=True, eos=True)


def test_small_file_gets_llama3_special_layout(tmp_path):
    path = tmp_path / "tiny.model"
    _write_ranks(path, [bytes([b]) for b in range(256)] + [b"he", b"ll", b"llo"])
    tok = build_tokenizer(str(path))
    n = 259
    assert tok.n_vocab == n + 256
    assert tok.bos_id == n and tok.eos_id == n + 1
    assert tok.special_tokens["<|start_header_id|>"] == n + 6
    assert tok.special_tokens["<|end_header_id|>"] == n + 7
    assert tok.special_tokens["<|eot_id|>"] == n + 9
    assert tok.special_tokens["<|reserved_special_token_250|>"] == n + 255
    # BPE merges by rank: h e l l o -> he l l o -> he ll o -> he llo
    assert tok.encode("hello", bos=True, eos=False) == [n, 256, 258]
    for text in TEXTS:
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_llama3_sized_file_gives_llama3_ids(tmp_path):
    # Same shape as Llama 3's tokenizer.model: 128000 ranks, then 256 special tokens.
    singles = [bytes([b]) for b in range(256)]
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    triples = [bytes([97 + a % 26, a // 26 % 256, 32 + a // (26 * 256)]) for a in range(128000 - 256 - 65536)]
    path = tmp_path / "tokenizer.model"
    _write_ranks(path, singles + pairs + triples)
    tok = build_tokenizer(str(path))
    assert tok.n_vocab == 128256
    assert (tok.bos_id, tok.eos_id) == (128000, 128001)
    assert tok.special_tokens["<|start_header_id|>"] == 128006
    assert tok.special_tokens["<|end_header_id|>"] == 128007
    assert tok.special_tokens["<|eot_id|>"] == 128009
    assert tok.special_tokens["<|reserved_special_token_5|>"] == 128010
    assert tok.special_tokens["<|reserved_special_token_250|>"] == 128255
    assert len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert tok.decode(tok.encode(TEXTS[2], bos=False, eos=False)) == TEXTS[2]


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "does not exist"),
        (b"", "no ranks"),
        (b"\x89PNG\r\n\x1a\n\x00\x00binary", "line 1"),
        (b'{"model": {"type": "BPE", "vocab": {}}}\n', "line 1"),
        (b"IQ== 0 extra\n", "line 1"),
        (b"!!!notbase64 0\n", "line 1"),
        (b"IQ== zero\n", "line 1"),
        (b"IQ== 0\nIg== 0\n", "repeats"),
        (b"IQ== 0\nIg== 1\n", "single-byte"),
    ],
)
def test_bad_files_raise_config_error(tmp_path, content, needle):
    path = tmp_path / "bad.tiktoken"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        build_tokenizer(str(path))
    assert str(path) in str(err.value) or "bad.tiktoken" in str(err.value)
    assert needle in str(err.value)


def test_bad_spec_values(tmp_path):
    with pytest.raises(ConfigError, match="model.tokenizer"):
        build_tokenizer("")
    with pytest.raises(ConfigError, match="does not exist"):
        build_tokenizer(str(tmp_path))  # a folder is not a BPE file


def test_bundled_bpe_is_reproducible(tmp_path):
    """The shipped ranks are what scripts/data/train_bpe.py makes from the shipped corpus."""
    from scripts.data import train_bpe

    out = tmp_path / "bpe.tiktoken"
    train_bpe.main(["--out", str(out)])
    with open(BUNDLED_BPE_PATH, "rb") as f:
        assert out.read_bytes() == f.read()
    assert os.path.getsize(out) < 100_000


# --- Hugging Face tokenizer.json (byte-level BPE) ---------------------------------------------

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
MULTILINGUAL = TEXTS + [
    "Die Würde des Menschen ist unantastbar. 人人生而自由，在尊严和权利上一律平等。",
    "كل إنسان له الحق في الحياة والحرية. हर व्यक्ति को जीवन का अधिकार है।",
    "Cafe\u0301 vs Café (NFD vs NFC), ﬁ ligature, １２３ full-width digits, 12345678 and 3.14159",
    "한국어 문장입니다. Türkçe İstanbul ıı, Tiếng Việt có dấu.",
    '    for i in range(10):\n        print(f"{i:>4}")  # 🚀\n',
]


def _train_hf_bpe(tmp_path, *, qwen_style: bool):
    """A byte-level BPE tokenizer.json trained by `tokenizers` (the reference implementation)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    if qwen_style:  # Qwen 2/3's layout: NFC, an isolated regex split, then ByteLevel without regex
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:  # GPT-2's layout: ByteLevel with its built-in regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = MULTILINGUAL * 20 + [
        open(os.path.join(os.path.dirname(BUNDLED_BPE_PATH), "..", "corpus", "README.md"), encoding="utf-8").read()
    ]
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


@pytest.mark.parametrize("qwen_style", [True, False], ids=["qwen-split-nfc", "gpt2-bytelevel"])
def test_tokenizer_json_ids_equal_reference(tmp_path, qwen_style):
    ref, path = _train_hf_bpe(tmp_path, qwen_style=qwen_style)
    ours = build_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert ours.n_vocab == ref.get_vocab_size()
    held_out = MULTILINGUAL + ["Unseen: Ωμέγα жёлтый 東京タワー 🧪🧬 naïveté d'être", "x" * 50 + " 0042"]
    # `tokenizers` turns an added token's string inside raw text into that token; we encode it as
    # plain text on purpose (data must not inject control tokens), so those texts differ by design.
    specials = [t for t in ours.special_tokens if any(t in x for x in held_out)]
    for text in [x for x in held_out if any(t in x for t in specials)]:
        assert not set(ours.encode(text, bos=False, eos=False)) & set(ours.special_tokens.values())
    held_out = [x for x in held_out if not any(t in x for t in specials)]
    assert len(held_out) >= 14
    for text in held_out:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, bos=False, eos=False) == expected, text
        assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=False), text
    assert ours.encode_batch(held_out, bos=False, eos=True) == [
        ref.encode(t, add_special_tokens=False).ids + [ours.eos_id] for t in held_out
    ]
    if qwen_style:  # Qwen: no BOS, EOS is <|endoftext|> with the file's id
        assert ours.bos_id is None and ours.eos_id == ref.token_to_id("<|endoftext|>")
        assert ours.encode("a", bos=True, eos=False) == ours.encode("a", bos=False, eos=False)
    else:
        assert (ours.bos_id, ours.eos_id) == (ref.token_to_id("<|begin_of_text|>"), ref.token_to_id("<|end_of_text|>"))


def test_tokenizer_json_refuses_what_tiktoken_cannot_express(tmp_path):
    import json

    _, path = _train_hf_bpe(tmp_path, qwen_style=True)
    spec = json.loads(path.read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]  # merge priority no longer follows id order
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="does not follow id order"):
        build_tokenizer(str(bad))
    spec = json.loads(path.read_text())
    spec["model"]["type"] = "Unigram"
    bad.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="allowed: BPE"):
        build_tokenizer(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        build_tokenizer(str(tmp_path / "missing.json"))
