"""FLUX data: procedural captions match pixels, the held-out split is held out, builds are
deterministic, the loader's global order is mesh independent and resumes exactly, the debug VAE
reconstructs, local-weight folders load through the real classes and bad paths fail cleanly.

Loader tests use a tiny data set (200 train rows in shards of 96, row groups of 16, so an
epoch spans 3 shards, 13 row groups and 2 shuffle blocks; VAE trained 2 steps: its quality is
irrelevant there). Float tensors are compared exactly: the loader copies stored float32
values, it computes nothing.
"""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from models.errors import ConfigError
from trainer.flux_data import build as fb
from trainer.flux_data import loader as fd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = fb.BuildParams(num_train=200, num_heldout=24, shard_rows=96, row_group_rows=16, vae_steps=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("flux") / "tiny")
    fb.build_dataset(TINY, folder, log=lambda _: None)
    return folder


def _loader(folder, dp_rank=0, dp_degree=1, batch=8, split="train", seed=3):
    return fd.build_flux_dataloader(
        path=folder, local_batch_size=batch, dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, split=split
    )


# --- the procedural set ------------------------------------------------------------------
@pytest.mark.parametrize("split,count", [("train", 2160), ("heldout", 96)])
def test_captions_match_pixels(split, count):
    """The classifier reads back the captioned colour and position of every default image
    (train: every train combination 20 times; held-out: 8 times each)."""
    images, rows = fb.procedural_samples(split, count, size=32, seed=0)
    got = fb.classify(images)
    wrong = [(row["caption"], g) for row, g in zip(rows, got) if g != (row["colour"], row["position"])]
    assert not wrong, wrong[:5]
    for row in rows:
        assert row["caption"] == fb.caption(row["colour"], row["shape"], row["position"])
    # The same classifier on float [B, 3, H, W] input (decoded samples are given that way).
    x = torch.from_numpy(images[:64]).permute(0, 3, 1, 2).float() / 255
    assert fb.classify(x) == got[:64]


def test_classify_sees_nothing_on_a_blank_image():
    blank = np.full((1, 32, 32, 3), 30, dtype=np.uint8)
    assert fb.classify(blank) == [(None, None)]


def test_heldout_combinations_never_in_train(tiny):
    held = set(fb.HELDOUT_COMBOS)
    assert len(held) == 12 and not held & set(fb.TRAIN_COMBOS)
    assert len(held) + len(fb.TRAIN_COMBOS) == len(fb.COLOURS) * len(fb.SHAPES) * len(fb.POSITIONS)
    # Every pair of attributes still occurs in train, so held-out prompts are new combinations
    # of known words, not new words.
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pairs = {(c[i], c[j]) for c in fb.TRAIN_COMBOS}
        assert all((c[i], c[j]) in pairs for c in held)
    ds = fd.FluxDataset(tiny)
    train = {(r["colour"], r["shape"], r["position"]) for r in ds.captions("train")}
    heldout = {(r["colour"], r["shape"], r["position"]) for r in ds.captions("heldout")}
    assert not train & held and heldout == held


def test_same_seed_same_bytes(tmp_path, tiny):
    a, rows_a = fb.procedural_samples("train", 50, size=32, seed=7)
    b, rows_b = fb.procedural_samples("train", 50, size=32, seed=7)
    c, _ = fb.procedural_samples("train", 50, size=32, seed=8)
    assert a.tobytes() == b.tobytes() and rows_a == rows_b
    assert a.tobytes() != c.tobytes()
    # The whole build (encoder init, VAE training, encoding, parquet) reproduces byte for byte.
    again = str(tmp_path / "again")
    fb.build_dataset(TINY, again, log=lambda _: None)
    for name in sorted(os.listdir(tiny)):
        if name.endswith(".parquet"):
            digest = [hashlib.sha256(open(os.path.join(f, name), "rb").read()).hexdigest() for f in (tiny, again)]
            assert digest[0] == digest[1], name


# --- the loader ----------------------------------------------------------------------------
def test_loader_shapes_and_epochs(tiny):
    loader = _loader(tiny)
    latents, t5, clip, index = loader.next_batch()
    assert latents.shape == (8, 16, 8, 8) and latents.dtype == torch.float32
    assert t5.shape == (8, 16, 64) and clip.shape == (8, 64) and index.dtype == torch.int64
    assert index.tolist() == list(range(8))
    # 50 batches of 8 = two epochs of 200: each epoch visits every row exactly once, in a
    # different order, and an epoch crosses the shuffle blocks and shards.
    loader = _loader(tiny)
    seen = [loader._rows(range(e * 200, (e + 1) * 200)) for e in range(2)]
    keys = [[row.tobytes() for row in s["latent"]] for s in seen]
    assert len(set(keys[0])) == 200 and set(keys[0]) == set(keys[1]) and keys[0] != keys[1]


@pytest.mark.parametrize("dp_degree", [2, 4])
def test_loader_global_order_is_mesh_independent(tiny, dp_degree):
    """Global batch 8 over 30 steps (past the 200-row epoch boundary): the ranks' slices,
    concatenated in rank order, are the dp=1 batch, tensors and indices alike."""
    single = _loader(tiny, batch=8)
    ranks = [_loader(tiny, r, dp_degree, batch=8 // dp_degree) for r in range(dp_degree)]
    for _ in range(30):
        want = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        for k in range(4):
            assert torch.equal(torch.cat([p[k] for p in parts]), want[k])


def test_resume_mid_epoch_reproduces_next_batches(tiny):
    loader = _loader(tiny, batch=6)
    for _ in range(7):
        loader.next_batch()
    state = loader.state_dict()
    want = [loader.next_batch() for _ in range(40)]  # past the epoch boundary
    resumed = _loader(tiny, batch=6)
    resumed.load_state_dict(state)
    for w in want:
        got = resumed.next_batch()
        assert all(torch.equal(a, b) for a, b in zip(got, w))
    # ... and on another mesh: rank slices of the same global batches.
    halves = [_loader(tiny, r, 2, batch=3) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for w in want[:5]:
        assert torch.equal(torch.cat([h.next_batch()[0] for h in halves]), w[0])
    other = _loader(tiny, seed=4)
    with pytest.raises(ConfigError, match="seed"):
        other.load_state_dict(state)


def test_loader_reads_only_the_row_groups_it_needs(tiny, monkeypatch):
    """A rank's first batch of 4 rows reads at most 4 row groups, all inside the first
    shuffle block (8 of the 13 groups)."""
    loader = _loader(tiny, dp_rank=1, dp_degree=2, batch=4)
    reads = []
    original = loader.dataset.read_group
    monkeypatch.setattr(loader.dataset, "read_group", lambda f, g: reads.append((f, g)) or original(f, g))
    loader.next_batch()
    assert 1 <= len(reads) <= 4
    order, _ = loader._blocks(0)
    first_block = {loader.groups[g][:2] for g in order[: fd.SHUFFLE_BLOCK_GROUPS]}
    assert set(reads) <= first_block and len(first_block) < len(loader.groups)


def test_heldout_split_is_read_once_in_order(tiny):
    loader = _loader(tiny, split="heldout", batch=5)
    assert loader.check(100) == 4  # 24 rows: 4 full batches of 5
    batches = list(loader)
    assert [b[3].tolist() for b in batches] == [list(range(i, i + 5)) for i in range(0, 20, 5)]
    captions = loader.dataset.captions("heldout")
    assert [c["index"] for c in captions] == list(range(24))
    with pytest.raises(ConfigError, match="fewer than one micro-batch"):
        _loader(tiny, split="heldout", batch=30).next_batch()


def test_bad_paths_and_splits_are_config_errors(tmp_path, tiny):
    with pytest.raises(ConfigError, match="no such folder"):
        _loader(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no meta.json"):
        _loader(str(tmp_path))
    with pytest.raises(ConfigError, match="no split 'validation'"):
        _loader(tiny, split="validation")


def test_a_batch_feeds_the_debug_transformer(tiny):
    """The data set's widths are the debugmodel's (context_in_dim = vec_in_dim = 64, 16
    latent channels packed 2x2 to in_channels 64): a loader batch runs through it."""
    from models.flux import FLAVORS, FluxTransformer
    from models.flux.latents import image_ids, pack, text_ids

    latents, t5, clip, _ = _loader(tiny, batch=2).next_batch()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = FluxTransformer(FLAVORS["debugmodel"])
    model.to_empty(device="cpu")
    model.init_weights()
    h, w = latents.shape[2:]
    out = model(pack(latents), image_ids(2, h, w), t5, text_ids(2, t5.shape[1]), torch.rand(2), clip, None)
    assert out.shape == (2, (h // 2) * (w // 2), 64) and torch.isfinite(out).all()


# --- conditioning ----------------------------------------------------------------------------
def test_text_conditioner_from_the_data_set(tiny):
    """The saved encoders reproduce the stored embeddings, and distinct captions differ."""
    ds = fd.FluxDataset(tiny)
    text = ds.text_conditioner()
    rows = ds.captions("train")[:4]
    t5, clip = text.encode([r["caption"] for r in rows])
    assert t5.shape == (4, 16, 64) and clip.shape == (4, 64)
    group = ds.read_group(ds.row_groups("train")[0][0], 0)
    # Same weights, same ids, same CPU kernels: equal up to batch-size-dependent summation
    # order in the matmuls (fp32, values O(1)): 1e-5.
    torch.testing.assert_close(t5, torch.from_numpy(group["t5"][:4].copy()), rtol=0, atol=1e-5)
    torch.testing.assert_close(clip, torch.from_numpy(group["clip"][:4].copy()), rtol=0, atol=1e-5)
    assert (t5[0] - t5[1]).abs().max() > 1e-2 and (clip[0] - clip[1]).abs().max() > 1e-2
    vae = ds.vae()
    images = vae.decode(torch.from_numpy(group["latent"][:2].copy()))
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1


def test_local_weight_folders_load_through_the_real_classes(tmp_path):
    """save_pretrained folders (with a tokenizer built offline) load with local_files_only
    through T5EncoderModel / CLIPTextModel / AutoencoderKL, as real FLUX folders would."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from models.flux import conditioning as cond

    words = ["<pad>", "</s>", "<unk>", "<|startoftext|>", "<|endoftext|>", "a", "red", "circle", "on", "the", "left"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    text = cond.build_debug_text_conditioner(_WordBpe(), max_length=8, seed=0)
    text.save(str(tmp_path))
    fast.save_pretrained(str(tmp_path / "t5"))
    fast.save_pretrained(str(tmp_path / "clip"))
    cond.build_debug_vae(0).save(str(tmp_path / "vae"))
    loaded = cond.load_text_conditioner(t5_path=str(tmp_path / "t5"), clip_path=str(tmp_path / "clip"), max_length=8)
    t5, clip = loaded.encode(["a red circle on the left", "a circle"])
    assert t5.shape == (2, 8, 64) and clip.shape == (2, 64)
    vae = cond.load_vae(str(tmp_path / "vae"))
    assert vae.encode(torch.rand(1, 3, 16, 16)).shape == (1, 16, 4, 4)
    # The build with local weights (the real-weights path: no VAE training, HF tokenizers),
    # and its saved encoders + tokenizers reproduce the stored embeddings.
    params = fb.BuildParams(
        num_train=16,
        num_heldout=12,
        text_length=8,
        t5_path=str(tmp_path / "t5"),
        clip_path=str(tmp_path / "clip"),
        vae_path=str(tmp_path / "vae"),
    )
    meta = fb.build_dataset(params, str(tmp_path / "data"), log=lambda _: None)
    assert meta["text_ids"] == "hf" and meta["vae_training"] is None
    assert meta["shapes"] == {"latent": [16, 8, 8], "t5": [8, 64], "clip": [64]}
    ds = fd.FluxDataset(str(tmp_path / "data"))
    group = ds.read_group(ds.row_groups("train")[0][0], 0)
    t5, clip = ds.text_conditioner().encode([r["caption"] for r in ds.captions("train")[:3]])
    torch.testing.assert_close(t5, torch.from_numpy(group["t5"][:3].copy()), rtol=0, atol=1e-5)
    torch.testing.assert_close(clip, torch.from_numpy(group["clip"][:3].copy()), rtol=0, atol=1e-5)


class _WordBpe:
    n_vocab, bos_id, eos_id = 11, 3, 4

    def encode(self, text, *, bos, eos):
        return [5] * len(text.split())


def test_missing_local_weights_fail_cleanly(tmp_path):
    from models.flux import conditioning as cond

    with pytest.raises(ConfigError, match="does not exist"):
        cond.load_vae(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no config.json"):
        cond.load_vae(str(tmp_path))
    missing = str(tmp_path / "t5-weights")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "data", "build_flux_data.py"),
            "--out",
            str(tmp_path / "out"),
            "--t5",
            missing,
            "--clip",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and missing in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_concurrent_first_use_builds_once(tmp_path):
    """Two processes asking for the same uncached set at once: one builds (under the lock),
    the other waits and reuses it; both get the same folder and no temporary folder is left."""
    code = (
        "import sys; from trainer.flux_data import build as fb; "
        "p = fb.BuildParams(num_train=40, num_heldout=12, vae_steps=1, shard_rows=32, row_group_rows=8); "
        "print('FOLDER', fb.ensure_procedural_dataset(p, cache_root=sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    folders = {line for out, _ in outs for line in out.splitlines() if line.startswith("FOLDER")}
    builds = sum(out.count("building the procedural FLUX data set") for out, _ in outs)
    assert len(folders) == 1 and builds == 1, outs
    name = os.path.basename(folders.pop().split(maxsplit=1)[1])
    assert sorted(os.listdir(tmp_path)) == [name, name + ".lock"]
    assert os.path.isfile(tmp_path / name / "meta.json")


# --- the default debug set (built once per machine, cached) ----------------------------------
@pytest.mark.slow
def test_default_vae_round_trip_classifies_as_captioned():
    """Decode(encode(image)) of the default debug VAE keeps each image's colour and position.

    Bound: >= 97% of train and of held-out images classify as captioned after the round
    trip (the originals: 100%, test_captions_match_pixels). A VAE that did not invert its
    encoder decodes to noise, where the classifier finds the captioned colour and position
    for about 1/30 of images. The margin under 100% allows a few small, thin shapes
    (triangles at radius 0.16) to blur below the foreground threshold. Also: the stored
    latents are normalized as FLUX normalizes (mean 0, std 1 over the train set, to 1e-3).
    """
    folder = fb.ensure_procedural_dataset()
    ds = fd.FluxDataset(folder)
    vae = ds.vae()
    for split in ("train", "heldout"):
        assert ds.meta["splits"][split]["vae_reconstruction_agreement"] >= 0.97, ds.meta["splits"][split]
    images, rows = fb.procedural_samples("heldout", 96, size=32, seed=0)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    recon = vae.decode(vae.encode(x))
    agree = np.mean([g == (r["colour"], r["position"]) for g, r in zip(fb.classify(recon), rows)])
    assert agree >= 0.97
    latents = np.concatenate([ds.read_group(f, g)["latent"] for f, g, _, _ in ds.row_groups("train")])
    assert abs(latents.mean()) < 1e-3 and abs(latents.std() - 1) < 1e-3
