"""Preference data: TRL's DPO tokenization (edl.text.encode_preference, load_tokenized's
cache) and edl.train.PreferenceBatches.

Token ids and batches are checked against TRL 1.16's own code on the same tokenizer: its
``DPOTrainer._prepare_dataset`` (EOS, chat template, prompt / response split), called
unbound on a ``datasets.Dataset`` with a stand-in for the trainer (it reads only the
tokenizer and three config fields, so no model or trainer is built), and its
``DataCollatorForPreference`` (truncation, padding, completion mask). Byte-tokenizer
expectations are written out by hand.
"""

from __future__ import annotations

import json
import re
import types

import numpy as np
import pytest
from jaxtyping import install_import_hook

from edl.text import (
    IGNORE_INDEX,
    ByteTokenizer,
    TokenizedDataset,
    encode_preference,
    load_tokenized,
    load_tokenizer,
)

with install_import_hook("edl", "beartype.beartype"):
    from edl.train import PreferenceBatches, TokenBatches
    from edl.train.preference_data import PREFERENCE_KEYS

BYTES = ByteTokenizer()
EOS, PAD = BYTES.eos_id, BYTES.pad_id

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question.",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRINGS = [
    {"prompt": "The quick brown", "chosen": " fox jumps over the lazy dog.", "rejected": " dog"},
    {"prompt": "The ", "chosen": "quick fox", "rejected": "lazy dog</s>"},  # "Ġqu"; has EOS
    {"prompt": "Grüße aus Köln:", "chosen": " 東京", "rejected": ""},  # EOS only
]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CHATS = [
    {
        "prompt": [{"role": "system", "content": "You are a helpful assistant."}, user("Hi")],
        "chosen": [assistant("Hello world")],
        "rejected": [assistant("fox")],
    },
    {
        "prompt": [user("2+2?"), assistant("5"), user("Sure?")],
        "chosen": [assistant("4, sorry.")],
        "rejected": [assistant("")],
    },
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A ChatML byte-level BPE whose default encoding prepends ``<s>`` (as Llama's):
    edl's tokenizer and transformers' on the same files."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def trl_tokenized(hf, records, max_length=None, truncation_mode="keep_start"):
    """TRL 1.16's DPO dataset preparation, unbound, on a stand-in trainer."""
    datasets = pytest.importorskip("datasets")
    dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    trainer = types.SimpleNamespace(_tokenizer=hf)
    args = types.SimpleNamespace(
        dataset_num_proc=None, max_length=max_length, truncation_mode=truncation_mode
    )
    out = dpo.DPOTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(records), hf, args, "test"
    )
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in out]


def as_lists(pair):
    return {k: np.asarray(v).tolist() for k, v in pair.items()}


@pytest.mark.filterwarnings("ignore:encode_preference. the prompt")
@pytest.mark.filterwarnings("ignore:load_tokenized. 1 of 3 records warned")
@pytest.mark.parametrize("records", [STRINGS, CHATS], ids=["strings", "conversations"])
def test_token_ids_and_batches_equal_trls(tmp_path, hf_tokenizer, records):
    pytest.importorskip("torch")  # TRL's collator returns torch tensors
    dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    tok, hf = hf_tokenizer
    theirs = trl_tokenized(hf, records)
    ours = [encode_preference(tok, r) for r in records]
    assert [as_lists(p) for p in ours] == theirs
    cached = load_tokenized(
        write_jsonl(tmp_path / "p.jsonl", records),
        tok,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    assert [as_lists(p) for p in cached] == theirs
    assert all(p["prompt_ids"][0] == tok.bos_id for p in theirs) == (records is STRINGS)

    # TRL's collator on the same pairs: rows prompt + response cut to max_length, then
    # padded to the longest; its completion_mask is where our labels are not -100.
    lengths = [
        len(p["prompt_ids"]) + len(p[k]) for p in theirs for k in ("chosen_ids", "rejected_ids")
    ]
    max_length = max(lengths) - 3  # some rows are cut
    for mode in ("keep_start", "keep_end"):
        collate = dpo.DataCollatorForPreference(
            pad_token_id=tok.pad_id, max_length=max_length, truncation_mode=mode
        )
        want = {k: v.numpy() for k, v in collate(theirs).items()}
        if mode == "keep_start":  # TRL drops pairs whose prompt fills max_length
            assert all(len(p["prompt_ids"]) < max_length for p in theirs)
        it = PreferenceBatches(
            cached,
            batch_size=len(records),
            max_length=max_length,
            pad_id=tok.pad_id,
            truncation=mode,
            shuffle=False,
        )
        batch = next(it)
        assert sorted(batch) == sorted(PREFERENCE_KEYS)
        assert all(a.dtype == np.int32 for a in batch.values())
        n = len(records)
        width = want["input_ids"].shape[1]
        assert width == max_length
        for side, rows in (("chosen", slice(None, n)), ("rejected", slice(n, None))):
            ids, mask = want["input_ids"][rows], want["attention_mask"][rows]
            labels = np.where(want["completion_mask"][rows] == 1, ids, IGNORE_INDEX)
            np.testing.assert_array_equal(batch[f"{side}_input_ids"], ids)
            np.testing.assert_array_equal(batch[f"{side}_attention_mask"], mask)
            np.testing.assert_array_equal(batch[f"{side}_labels"], labels)


def test_a_prompt_token_spanning_the_boundary_warns_and_moves_to_the_response(hf_tokenizer):
    tok, _ = hf_tokenizer
    record = STRINGS[1]  # "The " + "quick": the space merges with the response ("Ġqu")
    with pytest.warns(UserWarning, match=r"prompt's 3 tokens are not a prefix .* share 2"):
        pair = encode_preference(tok, record)
    assert tok.decode(pair["prompt_ids"]) == "<s>The"
    assert tok.decode(pair["chosen_ids"]) == " quick fox</s>"
    assert len(tok.encode(record["prompt"], add_bos=True)) == 3


# --- byte-level expectations --------------------------------------------------------------


def pairs(n, seed=0):
    """``n`` random pairs: prompts 1..6 tokens, responses 1..5 (ids < 250)."""
    rng = np.random.default_rng(seed)
    ids = lambda low, high: rng.integers(0, 250, rng.integers(low, high)).astype(np.int32)
    return [
        {"prompt_ids": ids(1, 7), "chosen_ids": ids(1, 6), "rejected_ids": ids(1, 6)}
        for _ in range(n)
    ]


def test_labels_mask_the_prompt_and_padding_and_truncation_cuts_as_asked():
    pair = encode_preference(BYTES, {"prompt": "abc", "chosen": "de", "rejected": "f"})
    assert as_lists(pair) == {
        "prompt_ids": [97, 98, 99],
        "chosen_ids": [100, 101, EOS],
        "rejected_ids": [102, EOS],
    }
    assert encode_preference(BYTES, {"prompt": "a", "chosen": "b", "rejected": "c"}, add_eos=False)[
        "rejected_ids"
    ].tolist() == [99]
    M = IGNORE_INDEX

    def first(max_length, **kwargs):
        return next(
            PreferenceBatches([pair], batch_size=1, max_length=max_length, pad_id=PAD, **kwargs)
        )

    batch = first(8)
    assert batch["chosen_input_ids"].tolist() == [[97, 98, 99, 100, 101, EOS, PAD, PAD]]
    assert batch["chosen_labels"].tolist() == [[M, M, M, 100, 101, EOS, M, M]]
    assert batch["chosen_attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [[97, 98, 99, 102, EOS, PAD, PAD, PAD]]
    assert batch["rejected_labels"].tolist() == [[M, M, M, 102, EOS, M, M, M]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    it = PreferenceBatches([pair], batch_size=1, max_length=4, pad_id=PAD)
    batch = next(it)  # keep_start: the response's end is cut
    assert batch["chosen_labels"].tolist() == [[M, M, M, 100]]
    assert batch["rejected_input_ids"].tolist() == [[97, 98, 99, 102]]
    assert it.truncated == 1 and it.dropped == 0
    batch = first(4, truncation="keep_end")  # the prompt's start is cut
    assert batch["chosen_input_ids"].tolist() == [[99, 100, 101, EOS]]
    assert batch["chosen_labels"].tolist() == [[M, 100, 101, EOS]]
    assert batch["rejected_labels"].tolist() == [[M, M, 102, EOS]]
    batch = first(5, max_prompt_length=1)  # the prompt's last token only
    assert batch["chosen_input_ids"].tolist() == [[99, 100, 101, EOS, PAD]]
    assert batch["rejected_labels"].tolist() == [[M, 102, EOS, M, M]]

    long_prompt = {**pair, "prompt_ids": np.arange(6, dtype=np.int32)}
    it = PreferenceBatches(
        [long_prompt, pair], batch_size=1, max_length=5, pad_id=PAD, shuffle=False
    )
    with pytest.warns(UserWarning, match=r"documents\[0\] keeps no response token"):
        assert next(it)["chosen_input_ids"][0, :3].tolist() == [97, 98, 99]
    assert it.dropped == 1
    with (
        pytest.raises(ValueError, match="none of the 1 pairs keeps a response token"),
        pytest.warns(UserWarning, match="keeps no response token"),
    ):
        next(PreferenceBatches([long_prompt], batch_size=1, max_length=6, pad_id=PAD))


# --- iteration ----------------------------------------------------------------------------


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_batches_are_deterministic_shuffled_per_epoch_and_split_over_processes():
    docs = pairs(10)
    kwargs = dict(batch_size=4, max_length=12, pad_id=PAD, seed=3)
    run = [next(it) for it in [PreferenceBatches(docs, **kwargs)] for _ in range(8)]
    again = PreferenceBatches(docs, **kwargs)
    for want in run:
        assert_batches_equal(next(again), want)
    # Epoch 0 of 10 pairs in rows 0..9: the seed's permutation, every pair once.
    order = np.random.default_rng((3, 0)).permutation(10)
    first = np.concatenate([b["chosen_input_ids"] for b in run])[:10]
    for row, doc_id in zip(first, order, strict=True):
        doc = docs[doc_id]
        seq = np.concatenate([doc["prompt_ids"], doc["chosen_ids"]])
        assert row[: len(seq)].tolist() == seq.tolist()
    other = next(PreferenceBatches(docs, **{**kwargs, "seed": 4}))
    assert not np.array_equal(other["chosen_input_ids"], run[0]["chosen_input_ids"])

    parts = [PreferenceBatches(docs, **kwargs, process_index=p, process_count=2) for p in (0, 1)]
    for want in run:
        got = [next(p) for p in parts]
        for key in want:
            assert got[0][key].shape == (2, 12)
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])
        assert parts[0].position == parts[1].position
    with pytest.raises(ValueError, match=r"batch_size 4 .* divisible by process_count 3"):
        PreferenceBatches(docs, **kwargs, process_count=3)


def test_resume_from_a_saved_position_is_exact_and_checks_the_config(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "prompt": f"q{i}: " + "x" * (i % 4),
                "chosen": "y" * (i % 3),
                "rejected": "z" * (i % 5),
            }
            for i in range(13)
        ],
    )
    data = load_tokenized(path, BYTES, cache_dir=tmp_path / "cache", progress=False)
    kwargs = dict(batch_size=3, max_length=10, pad_id=PAD, seed=1)
    expected = [next(it) for it in [PreferenceBatches(data, **kwargs)] for _ in range(12)]
    first = PreferenceBatches(data, **kwargs)
    [next(first) for _ in range(5)]
    saved = json.loads(json.dumps(first.position))
    assert saved["offset"] == 0 and saved["epoch"] == 1  # 15 of 13 pairs: into epoch 1
    resumed = PreferenceBatches(
        load_tokenized(path, BYTES, cache_dir=tmp_path / "cache", progress=False), **kwargs
    )
    resumed.restore(saved)
    for want in expected[5:]:
        assert_batches_equal(next(resumed), want)
    mismatch = r"PreferenceBatches.restore: position field 'max_length' is 10 but .* has 11"
    with pytest.raises(ValueError, match=mismatch):
        PreferenceBatches(data, **{**kwargs, "max_length": 11}).restore(saved)
    with pytest.raises(ValueError, match=r"'index' must be an int in \[0, 12\]"):
        PreferenceBatches(data, **kwargs).restore({**saved, "index": 13})


def test_one_pass_pads_the_last_batch_with_empty_rows():
    docs = pairs(5)
    it = PreferenceBatches(docs, batch_size=2, max_length=12, pad_id=PAD, repeat=False)
    batches = list(it)
    assert len(batches) == 3
    last = batches[-1]
    assert last["chosen_attention_mask"][0].any() and not last["chosen_attention_mask"][1].any()
    assert (last["rejected_labels"][1] == IGNORE_INDEX).all()
    assert (last["rejected_input_ids"][1] == PAD).all()


# --- the cache and errors -----------------------------------------------------------------


class CountingBytes:
    """Bytes, counting ``encode`` calls; its fingerprint is settable."""

    eos_id, pad_id = EOS, PAD

    def __init__(self, fingerprint="count/1"):
        self.fingerprint, self.calls = fingerprint, 0

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        self.calls += 1
        return BYTES.encode(text, add_bos=add_bos, add_eos=add_eos)


def test_cache_hits_and_invalidates_on_tokenizer_and_options(tmp_path, capfd):
    records = [
        {"prompt": "a", "chosen": "b", "rejected": "c"},
        {"prompt": "d", "chosen": "e", "rejected": "f"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    cache = tmp_path / "cache"
    tok = CountingBytes()
    first = load_tokenized(path, tok, cache_dir=cache)
    assert tok.calls == 6 and "tokenizing" in capfd.readouterr().err  # 3 encodes a pair
    again = load_tokenized(path, tok, cache_dir=cache)
    assert tok.calls == 6 and again.path == first.path  # a hit: the tokenizer is not called
    assert "tokenizing" not in capfd.readouterr().err
    assert as_lists(again[1]) == {
        "prompt_ids": [100],
        "chosen_ids": [101, EOS],
        "rejected_ids": [102, EOS],
    }
    assert again.meta["fields"] == ["prompt_ids", "chosen_ids", "rejected_ids"]
    assert again.num_tokens == 10 and not again.meta["has_labels"]
    no_eos = load_tokenized(path, tok, cache_dir=cache, add_eos=False, progress=False)
    assert tok.calls == 12 and no_eos.path != first.path
    assert no_eos[0]["chosen_ids"].tolist() == [98]
    other = load_tokenized(path, CountingBytes("count/2"), cache_dir=cache, progress=False)
    assert other.path not in (first.path, no_eos.path)
    reopened = TokenizedDataset.open(first.path)
    assert [as_lists(d) for d in reopened] == [as_lists(d) for d in first]
    # An SFT-style iterator refuses preference documents by name.
    with pytest.raises(ValueError, match=r"documents\[\d\] is a dict with neither 'input_ids'"):
        next(TokenBatches(reopened, batch_size=1, max_length=8))


def test_errors_name_the_record_and_the_document(tmp_path, hf_tokenizer):
    tok, _ = hf_tokenizer
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "a", "chosen": "b", "rejected": "c"},
            {
                "prompt": [user("x")],
                "chosen": [assistant("y")],
                "rejected": [{"role": "assistant"}],
            },
        ],
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: rejected\[0\]\.content must be a string"):
        load_tokenized(bad, tok, cache=False, progress=False)
    chats = write_jsonl(
        tmp_path / "chats.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, *CHATS]
    )
    with pytest.raises(ValueError, match=r"chats\.jsonl:2: chat records need an HFTokenizer"):
        load_tokenized(chats, BYTES, cache=False, progress=False)
    with pytest.raises(ValueError, match="all strings or all lists of messages"):
        encode_preference(BYTES, {"prompt": "a", "chosen": ["b"], "rejected": "c"})
    with pytest.raises(ValueError, match=re.escape("documents[1]['chosen_ids'] must be a 1-D")):
        next(
            PreferenceBatches(
                [*pairs(1), {**pairs(1)[0], "chosen_ids": [[1]]}],
                batch_size=2,
                max_length=8,
                pad_id=PAD,
                shuffle=False,
            )
        )
    with pytest.raises(ValueError, match=r"documents\[0\] must be a dict with \['prompt_ids'"):
        next(PreferenceBatches([{"input_ids": [1]}], batch_size=1, max_length=8, pad_id=PAD))


def test_load_tokenized_sums_up_boundary_warnings_naming_the_first_record(tmp_path, hf_tokenizer):
    tok, _ = hf_tokenizer
    path = write_jsonl(tmp_path / "w.jsonl", [STRINGS[0], STRINGS[1], STRINGS[1]])
    with pytest.warns(
        UserWarning,
        match=r"2 of 3 records warned; the first, .*w\.jsonl:2: "
        r"encode_preference: the prompt's 3 tokens",
    ):
        load_tokenized(path, tok, cache=False, progress=False)
