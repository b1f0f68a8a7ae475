"""edl.train data pipeline: byte tokenizer, default corpus, collators, resumable batches."""

import itertools
import json
import pathlib
import sysconfig

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jaxtyping import install_import_hook

# edl/__init__ does not import edl.train, so conftest's hook has not seen it: check it here.
with install_import_hook("edl", "beartype.beartype"):
    from edl.text import IGNORE_INDEX
    from edl.train import (
        ByteTokenizer,
        TokenBatches,
        batches_from_iterable,
        load_corpus,
        split_corpus,
    )
    from edl.train.data import pack_sequences, pad_batch
    from edl.train.text import default_corpus_files

KEYS = {"input_ids", "attention_mask", "labels", "position_ids", "segment_ids"}


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert a[key].dtype == b[key].dtype == np.int32


# --- tokenizer ---------------------------------------------------------------------------


@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < 256 for i in ids[1:-1])
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(tok.encode(text))) == text


def test_byte_tokenizer_basics():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.name) == (
        259,
        256,
        257,
        258,
        "bytes",
    )
    assert tok.encode("aé€") == [97, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert tok.decode([97, 256, 0xE2, 0x82]) == "a\ufffd"  # a cut character is replaced
    with pytest.raises(ValueError, match="id 259"):
        tok.decode([1, 259])


# --- corpus -------------------------------------------------------------------------------


def test_default_corpus_files():
    files = default_corpus_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == default_corpus_files()
    relative = [f.relative_to(root).as_posix() for f in files]
    assert relative == sorted(relative)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    banned = {"site-packages", "test", "tests", "idle_test"}
    assert not any(banned & set(pathlib.PurePosixPath(r).parts[:-1]) for r in relative)
    assert "os.py" in relative and "json/__init__.py" in relative


def test_load_corpus_max_bytes():
    docs = load_corpus(max_bytes=20_000)
    assert docs == load_corpus(max_bytes=20_000)
    size = sum(len(d.encode()) for d in docs)
    assert 20_000 - 3 <= size <= 20_000
    first = default_corpus_files()[0].read_text(encoding="utf-8")
    assert docs[0] == first
    assert load_corpus(max_bytes=10) == [first.encode()[:10].decode()]
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(max_bytes=0)


def test_load_corpus_cuts_at_character_boundary(tmp_path):
    (tmp_path / "a.py").write_text("x€y", encoding="utf-8")  # 1 + 3 + 1 bytes
    (tmp_path / "b.py").write_bytes(b"\xff ok")
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    assert load_corpus(files) == ["x€y", "\ufffd ok"]
    assert load_corpus(files, max_bytes=3) == ["x"]
    assert load_corpus(files, max_bytes=4) == ["x€"]
    assert load_corpus(files, max_bytes=7) == ["x€y", "\ufffd "]


def test_split_corpus():
    docs = list(range(100))
    train, evals = split_corpus(docs, eval_fraction=0.1)
    assert len(evals) == 10 and sorted(train + evals) == docs
    assert evals == sorted(evals) and evals[0] > 0 and evals[-1] > 90  # spread out
    assert split_corpus(docs, 0.1) == (train, evals)
    assert split_corpus(["a", "b", "c"]) == (["a", "c"], ["b"])  # at least one eval doc
    assert split_corpus(["a"]) == (["a"], [])
    assert split_corpus(docs, 0.0) == (docs, [])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_corpus(docs, 1.0)


# --- pad_batch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("truncation", "padding_side", "ids", "mask", "pos"),
    [
        (
            "keep_end",
            "right",
            [[3, 4, 5, 6], [7, 8, 0, 0]],
            [[1, 1, 1, 1], [1, 1, 0, 0]],
            [[0, 1, 2, 3], [0, 1, 0, 0]],
        ),
        (
            "keep_start",
            "right",
            [[1, 2, 3, 4], [7, 8, 0, 0]],
            [[1, 1, 1, 1], [1, 1, 0, 0]],
            [[0, 1, 2, 3], [0, 1, 0, 0]],
        ),
        (
            "keep_end",
            "left",
            [[3, 4, 5, 6], [0, 0, 7, 8]],
            [[1, 1, 1, 1], [0, 0, 1, 1]],
            [[0, 1, 2, 3], [0, 0, 0, 1]],
        ),
        (
            "keep_start",
            "left",
            [[1, 2, 3, 4], [0, 0, 7, 8]],
            [[1, 1, 1, 1], [0, 0, 1, 1]],
            [[0, 1, 2, 3], [0, 0, 0, 1]],
        ),
    ],
)
def test_pad_batch(truncation, padding_side, ids, mask, pos):
    seqs = [[1, 2, 3, 4, 5, 6], np.array([7, 8])]
    out = pad_batch(seqs, 4, pad_id=0, truncation=truncation, padding_side=padding_side)
    assert set(out) == {"input_ids", "attention_mask", "labels", "position_ids"}
    assert all(v.dtype == np.int32 and v.shape == (2, 4) for v in out.values())
    np.testing.assert_array_equal(out["input_ids"], ids)
    np.testing.assert_array_equal(out["attention_mask"], mask)
    np.testing.assert_array_equal(out["position_ids"], pos)
    np.testing.assert_array_equal(out["labels"], np.where(np.array(mask) == 1, ids, -100))


def test_pad_batch_errors():
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        pad_batch([[1]], 0, pad_id=0)
    with pytest.raises(ValueError, match="sequences"):
        pad_batch([], 4, pad_id=0)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        pad_batch([[1], [-2]], 4, pad_id=0)
    # Literal annotations: beartype (under test) or the function itself names the argument.
    with pytest.raises((ValueError, TypeError), match="truncation"):
        pad_batch([[1]], 4, pad_id=0, truncation="middle")
    with pytest.raises((ValueError, TypeError), match="padding_side"):
        pad_batch([[1]], 4, pad_id=0, padding_side="up")


# --- pack_sequences -----------------------------------------------------------------------

token_lists = st.lists(st.lists(st.integers(0, 1000), max_size=20), max_size=12)


@given(token_lists, st.integers(1, 9))
def test_pack_sequences_invariants(seqs, max_length):
    out = pack_sequences(seqs, max_length, pad_id=7)
    rows = len(out["input_ids"])
    assert set(out) == KEYS
    assert all(v.shape == (rows, max_length) and v.dtype == np.int32 for v in out.values())
    seg, ids, pos = out["segment_ids"], out["input_ids"], out["position_ids"]
    pad = seg == 0
    np.testing.assert_array_equal(out["attention_mask"], ~pad)
    np.testing.assert_array_equal(out["labels"], np.where(pad, IGNORE_INDEX, ids))
    assert (ids[pad] == 7).all() and (pos[pad] == 0).all()
    # Real tokens form a prefix of each row; segments are numbered 1, 2, ... in order.
    assert (np.diff(pad.astype(int), axis=1) >= 0).all()
    assert (np.diff(seg, axis=1)[~pad[:, 1:]] >= 0).all()
    # Every segment is one chunk of one sequence, positions 0..n-1; all chunks appear once,
    # in first-fit order (chunks of a sequence stay in order, each at most max_length long).
    segments = []
    for r in range(rows):
        for s in range(1, seg[r].max(initial=0) + 1):
            where = seg[r] == s
            np.testing.assert_array_equal(pos[r, where], np.arange(where.sum()))
            assert (np.flatnonzero(where) == np.flatnonzero(where)[0] + pos[r, where]).all()
            segments.append((r, ids[r, where].tolist()))
    chunks = [s[i : i + max_length] for s in seqs for i in range(0, len(s), max_length)]
    assert sorted(c for _, c in segments) == sorted(chunks)
    # Placement order: replaying first-fit gives the same rows.
    room: list[int] = []
    expected_rows = []
    for c in chunks:
        r = next((r for r, free in enumerate(room) if free >= len(c)), len(room))
        if r == len(room):
            room.append(max_length)
        room[r] -= len(c)
        expected_rows.append((r, c))
    assert sorted(segments, key=lambda x: x[0]) == sorted(expected_rows, key=lambda x: x[0])


def test_pack_sequences_example():
    out = pack_sequences([[1, 2, 3], [], [4, 5, 6, 7, 8, 9], [10]], 4, pad_id=0)
    np.testing.assert_array_equal(out["input_ids"], [[1, 2, 3, 10], [4, 5, 6, 7], [8, 9, 0, 0]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0]])
    assert pack_sequences([[], []], 4, pad_id=0)["input_ids"].shape == (0, 4)


# --- TokenBatches -------------------------------------------------------------------------

DOCS = [f"document {i}: " + "abcdefgh"[: i % 8] * (i % 5 + 1) for i in range(23)] + [""]


def take(it, n):
    return [next(it) for _ in range(n)]


def test_token_batches_deterministic():
    make = lambda seed: TokenBatches(DOCS, batch_size=3, max_length=16, seed=seed)
    a, b, c = take(make(0), 12), take(make(0), 12), take(make(1), 12)
    for x, y in zip(a, b, strict=True):
        assert_batches_equal(x, y)
    assert any((x["input_ids"] != z["input_ids"]).any() for x, z in zip(a, c, strict=True))
    for batch in a:
        assert set(batch) == KEYS
        assert all(v.shape == (3, 16) and v.dtype == np.int32 for v in batch.values())
        assert batch["attention_mask"].all()  # packed with repeat: no padding


def test_token_batches_stream_order():
    """Unshuffled packing is the concatenated (EOS-terminated) documents, cut into rows."""
    tok = ByteTokenizer()
    it = TokenBatches(DOCS, batch_size=2, max_length=8, shuffle=False, repeat=False)
    stream = [t for d in DOCS for t in tok.encode(d, add_eos=True)]  # "" is [eos]
    batches = list(it)
    ids = np.concatenate([b["input_ids"].reshape(-1) for b in batches])
    real = np.concatenate([b["attention_mask"].reshape(-1) for b in batches]) == 1
    assert ids[real].tolist() == stream
    assert real[: len(stream)].all() and not real[len(stream) :].any()  # only the end padded
    assert len(ids) - len(stream) < 16
    with pytest.raises(StopIteration):
        next(it)
    # A document cut at a row end continues in the next row as segment 1, positions from 0.
    first = batches[0]
    assert first["segment_ids"][1, 0] == 1 and first["position_ids"][1, 0] == 0


@pytest.mark.filterwarnings("ignore:documents.*more than max_length")
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize(("k", "m"), [(0, 5), (3, 7), (11, 9)])
def test_token_batches_resume(pack, k, m):
    kwargs = dict(batch_size=2, max_length=12, pack=pack, seed=5)
    it = TokenBatches(DOCS, **kwargs)
    take(it, k)
    saved = it.position
    expected = take(it, m)
    for position in (saved, json.loads(json.dumps(saved))):
        fresh = TokenBatches(DOCS, **kwargs)
        fresh.restore(position)
        for want, got in zip(expected, take(fresh, m), strict=True):
            assert_batches_equal(want, got)
    it.restore(saved)  # restoring the same iterator rewinds it
    assert_batches_equal(next(it), expected[0])


def test_token_batches_restore_mismatch():
    position = TokenBatches(DOCS, batch_size=2, max_length=12).position
    for field, kwargs in [
        ("seed", dict(seed=1)),
        ("batch_size", dict(batch_size=3)),
        ("max_length", dict(max_length=10)),
        ("pack", dict(pack=False)),
    ]:
        other = TokenBatches(DOCS, **{"batch_size": 2, "max_length": 12, **kwargs})
        with pytest.raises(ValueError, match=f"'{field}'"):
            other.restore(position)
    with pytest.raises(ValueError, match="'num_documents'"):
        TokenBatches(DOCS[:-1], batch_size=2, max_length=12).restore(position)
    with pytest.raises(ValueError, match="'offset'"):
        TokenBatches(DOCS, batch_size=2, max_length=12).restore({**position, "offset": -1})
    with pytest.raises(ValueError, match="'epoch'"):
        TokenBatches(DOCS, batch_size=2, max_length=12).restore(
            {k: v for k, v in position.items() if k != "epoch"}
        )


def test_token_batches_epochs():
    """Each epoch visits every document once, in a seed- and epoch-dependent order."""
    docs = [[i] for i in range(10)]
    it = TokenBatches(docs, batch_size=1, max_length=10, seed=3)
    first, second = next(it)["input_ids"][0], next(it)["input_ids"][0]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first.tolist() == np.random.default_rng((3, 0)).permutation(10).tolist()
    assert second.tolist() == np.random.default_rng((3, 1)).permutation(10).tolist()
    assert it.position["epoch"] == 2
    np.testing.assert_array_equal(next(it)["segment_ids"][0], np.arange(1, 11))


def test_token_batches_unpacked():
    docs = [{"input_ids": [1, 2, 3]}, {"text": "hello"}, [4] * 20, [], "xy"]
    it = TokenBatches(docs, batch_size=2, max_length=6, pack=False, shuffle=False, repeat=False)
    with pytest.warns(UserWarning, match=r"documents\[2\] has 20 tokens.*last 6 are kept"):
        batches = list(it)
    assert it.truncated == 1
    assert len(batches) == 2  # 4 non-empty documents: [] is skipped
    for batch in batches:
        assert set(batch) == KEYS
        assert all(v.shape == (2, 6) and v.dtype == np.int32 for v in batch.values())
        np.testing.assert_array_equal(batch["segment_ids"], batch["attention_mask"])
    tok = ByteTokenizer()
    np.testing.assert_array_equal(batches[0]["input_ids"][0], [1, 2, 3, 256, 256, 256])
    assert tok.decode(batches[0]["input_ids"][1]) == "hello"
    assert batches[0]["input_ids"][1, 5] == tok.eos_id
    np.testing.assert_array_equal(batches[1]["input_ids"][0], [4] * 6)
    np.testing.assert_array_equal(batches[1]["labels"][1], [120, 121, 258, -100, -100, -100])


def test_token_batches_partial_last_batch():
    it = TokenBatches([[1, 2, 3]], batch_size=3, max_length=2, repeat=False, pad_id=0)
    (batch,) = list(it)
    np.testing.assert_array_equal(batch["input_ids"], [[1, 2], [3, 0], [0, 0]])
    np.testing.assert_array_equal(batch["labels"], [[1, 2], [3, -100], [-100, -100]])
    assert it.position["epoch"] == 1


def test_token_batches_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TokenBatches(DOCS, batch_size=0, max_length=4)
    with pytest.raises(ValueError, match="documents is empty"):
        TokenBatches([], batch_size=1, max_length=4)
    with pytest.raises(ValueError, match="all 2 documents are empty"):
        next(TokenBatches(["", []], batch_size=1, max_length=4, add_eos=False))
    it = TokenBatches([[1, 2], {"oops": 1}], batch_size=1, max_length=4, shuffle=False)
    with pytest.raises(ValueError, match=r"documents\[1\].*'oops'"):
        next(it)
    assert it.position["index"] == 0  # a failed batch consumes nothing


@pytest.mark.filterwarnings("ignore:documents.*more than max_length")
def test_batches_from_iterable_matches_token_batches():
    gen = (d for d in DOCS)
    for pack in (True, False):
        got = list(batches_from_iterable(iter(DOCS), batch_size=2, max_length=8, pack=pack))
        want = list(
            TokenBatches(DOCS, batch_size=2, max_length=8, pack=pack, shuffle=False, repeat=False)
        )
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_batches_equal(a, b)
    assert len(list(itertools.islice(batches_from_iterable(gen, batch_size=1, max_length=4), 3)))
    with pytest.raises(ValueError, match="max_length"):
        batches_from_iterable([], batch_size=1, max_length=0)
