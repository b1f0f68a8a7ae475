"""edl.text's data sources and tokenized cache, and SFT batches through edl.train's iterators.

Expectations are written out independently: byte tokens of known strings, rows packed by
hand, ``datasets``' own reading of the same files; chat records against the tokenizers
that tests/test_text.py builds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re

import numpy as np
import pytest
from jaxtyping import install_import_hook
from test_text import CONVERSATIONS, loaded, tokenizer_dirs  # noqa: F401  (fixtures)

from edl.text import (
    IGNORE_INDEX,
    ByteTokenizer,
    TokenizedDataset,
    data_files,
    encode_chat,
    hf_dataset,
    load_tokenized,
    read_records,
    sources,
)
from edl.text.dataset import tokenizer_fingerprint
from edl.text.sources import Source, detect_format, resolve_files

with install_import_hook("edl", "beartype.beartype"):
    from edl.train import TokenBatches, batches_from_iterable

BYTES = ByteTokenizer()
EOS, PAD = BYTES.eos_id, BYTES.pad_id

RECORDS = {
    "text": [{"text": "hello"}, {"text": "Grüße\n\nzwei"}],
    "completion": [{"prompt": "Q: 1+1?", "completion": " 2"}, {"prompt": "Hi", "completion": "!"}],
    "chat": [{"messages": CONVERSATIONS["single"]}, {"messages": CONVERSATIONS["multi_turn"]}],
    "preference": [
        {"prompt": "Sky?", "chosen": "blue", "rejected": "green"},
        {
            "prompt": [{"role": "user", "content": "2+2?"}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
    ],
}


def write_jsonl(path, records, blank_after=None):
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class CountingTokenizer:
    """Bytes, counting ``encode`` calls; its fingerprint is settable."""

    def __init__(self, fingerprint="count/1"):
        self.fingerprint, self.calls, self.eos_id = fingerprint, 0, EOS

    @property
    def pad_id(self) -> int:
        return PAD

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        self.calls += 1
        return BYTES.encode(text, add_bos=add_bos, add_eos=add_eos)


class Unkeyed(CountingTokenizer):
    """A tokenizer with no fingerprint."""

    fingerprint = None

    def __init__(self):
        pass


# --- records ------------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["text", "completion", "chat", "preference"])
def test_each_format_reads_from_jsonl_and_json(tmp_path, format):
    jsonl = write_jsonl(tmp_path / "a.jsonl", RECORDS[format], blank_after=1)
    array = tmp_path / "b.json"
    array.write_text(json.dumps(RECORDS[format]), encoding="utf-8")
    for fmt in (format, "auto"):
        assert list(read_records(jsonl, format=fmt)) == RECORDS[format]
        assert list(read_records([array, jsonl], format=fmt)) == RECORDS[format] * 2
    assert detect_format(RECORDS[format][0], "x") == format


def test_record_errors_name_the_file_and_line(tmp_path):
    def error(lines, format="auto", name="bad.jsonl"):
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=re.escape(name)) as info:
            list(read_records(path, format=format))
        return str(info.value)

    ok = json.dumps({"prompt": "a", "completion": "b"})
    msg = error([ok, "", json.dumps({"prompt": "a"})])
    assert "bad.jsonl:3" in msg and "'completion'" in msg and "['prompt']" in msg
    assert "bad.jsonl:2: not valid JSON" in error([ok, "{oops"])
    assert "bad.jsonl:1: a record must be a JSON object" in error(["[1, 2]"])
    msg = error([json.dumps({"prompt": 1, "completion": "b"})])
    assert "bad.jsonl:1" in msg and "'prompt' must be a string, got int" in msg
    msg = error([json.dumps({"messages": [{"role": "user"}]})])
    assert "bad.jsonl:1: messages[0].content must be a string, got None" in msg
    assert "bad.jsonl:1: cannot tell the record's format" in error([json.dumps({"x": 1})])
    msg = error([ok], format="text")
    assert "bad.jsonl:1: format 'text' needs field(s) ['text']" in msg
    mixed = json.dumps({"prompt": "p", "chosen": "c", "rejected": [{"role": "a", "content": "x"}]})
    assert "bad.jsonl:1: field 'rejected' must be a string" in error([mixed])
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "a"}, {"txt": "b"}]))
    with pytest.raises(ValueError, match=r"arr\.json\[1\]: format 'text' needs"):
        list(read_records(tmp_path / "arr.json"))
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin\.jsonl:2: not UTF-8"):
        list(read_records(tmp_path / "latin.jsonl"))


def test_lone_surrogates_are_refused_naming_the_record_and_field(tmp_path, loaded):  # noqa: F811
    tok, _ = loaded["chatml"]
    ok = {"text": "caf\u00e9 \U0001f600"}  # json.dumps writes the emoji as a surrogate pair
    path = tmp_path / "s.jsonl"
    path.write_text(f'{json.dumps(ok)}\n{{"text": "ok \\ud800 no"}}\n', encoding="utf-8")
    want = r"s\.jsonl:2: field 'text' has a lone surrogate U\+D800 at character 3"
    for tokenizer in (BYTES, tok):
        with pytest.raises(ValueError, match=want):
            load_tokenized(path, tokenizer, cache=False, progress=False)
    with pytest.raises(ValueError, match=want):
        list(read_records(path))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\udfff"}]
    write_jsonl(path, [{"messages": CONVERSATIONS["single"]}, {"messages": chat}])
    with pytest.raises(ValueError, match=r"s\.jsonl:2: messages\[1\]\.content has a lone "):
        load_tokenized(path, tok, cache=False, progress=False)
    write_jsonl(path, [ok])
    assert list(read_records(path)) == [ok]


def test_deep_and_long_lines_are_refused_before_parsing(tmp_path, monkeypatch):
    ok = json.dumps({"text": "a"})
    deep = '{"text": "a", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    (tmp_path / "deep.jsonl").write_text(f"{ok}\n{deep}\n")
    (tmp_path / "deep.json").write_text(f"[{ok},\n{deep}]")
    bound = r"nest deeper than MAX_JSON_DEPTH \(100 levels in a record\)"
    for name in ("deep.jsonl", "deep.json"):  # a ValueError, not Python's RecursionError
        with pytest.raises(ValueError, match=rf"{name}:2: arrays / objects {bound}"):
            list(read_records(tmp_path / name))
    assert sources.MAX_JSON_DEPTH == 100
    nested = lambda depth: {"text": "a", "x": json.loads("[" * depth + "]" * depth)}
    # Brackets and escaped quotes inside strings do not nest.
    at_bound = [nested(99), {"text": '[{\\"[' * 300, "x": [[["]"]]]}]
    write_jsonl(tmp_path / "ok.jsonl", at_bound)
    (tmp_path / "ok.json").write_text(json.dumps(at_bound))
    assert list(read_records(tmp_path / "ok.jsonl")) == at_bound
    assert list(read_records(tmp_path / "ok.json")) == at_bound
    write_jsonl(tmp_path / "over.jsonl", [nested(100)])
    with pytest.raises(ValueError, match=rf"over\.jsonl:1: arrays / objects {bound}"):
        list(read_records(tmp_path / "over.jsonl"))

    assert sources.MAX_LINE_BYTES == 64 * 2**20
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 40)  # the real bound: a 64 MiB file
    fits = json.dumps({"text": "x" * 28})  # 40 bytes, then its newline
    path = tmp_path / "long.jsonl"
    path.write_text(f"{fits}\n{fits}x\n{ok}\n")
    with pytest.raises(ValueError, match=r"long\.jsonl:2: line longer than MAX_LINE_BYTES \(40 "):
        list(read_records(path))
    path.write_text(f"{fits}\n{fits}")
    assert len(list(read_records(path))) == 2


def test_chat_roles_are_the_servers(tmp_path):
    from edl.text.chat import ROLES

    assert list(ROLES) == ["system", "developer", "user", "assistant", "tool"]
    hacker = [{"role": "user", "content": "hi"}, {"role": "hacker", "content": "x"}]
    records = [{"messages": CONVERSATIONS["single"]}, {"messages": hacker}]
    path = write_jsonl(tmp_path / "r.jsonl", records)
    refusal = f"messages[1].role must be one of {list(ROLES)}, got 'hacker'"
    with pytest.raises(ValueError, match=re.escape(f"r.jsonl:2: {refusal}")):
        list(read_records(path))
    pair = {**RECORDS["preference"][1], "chosen": [{"role": "hacker", "content": "4"}]}
    write_jsonl(path, [pair])
    with pytest.raises(ValueError, match=re.escape("r.jsonl:1: chosen[0].role must be one of")):
        list(read_records(path, format="preference"))
    # OpenAI's developer is the system prompt, as the server gives it to the template.
    developer = [{"role": "developer", "content": "Be brief."}, *CONVERSATIONS["single"]]
    write_jsonl(path, [{"messages": developer, "id": 7}])
    [record] = read_records(path)
    assert record == {"messages": [{**developer[0], "role": "system"}, *developer[1:]], "id": 7}


def test_tokenizer_errors_of_other_types_name_the_record(tmp_path):
    class Failing(ByteTokenizer):
        def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False):
            if text == "bad":
                raise TypeError("cannot encode this")
            return super().encode(text, add_bos=add_bos, add_eos=add_eos)

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "good"}, {"text": "bad"}])
    with pytest.raises(TypeError, match="cannot encode this") as info:
        load_tokenized(path, Failing(), cache=False, progress=False)
    assert getattr(info.value, "__notes__", None) == [f"while tokenizing {path}:2"]


def test_text_files_directories_and_globs(tmp_path):
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    files = {"corpus/b.txt": "bee\n", "corpus/a.md": "a\n\nstill a\n", "corpus/sub/c.txt": "c"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "corpus" / ".hidden").write_text("no")
    order = ["corpus/a.md", "corpus/b.txt", "corpus/sub/c.txt"]
    assert resolve_files(tmp_path / "corpus") == [tmp_path / n for n in order]
    globbed = resolve_files([str(tmp_path / "corpus/**/*.txt"), tmp_path / "corpus/a.md"])
    assert globbed == [tmp_path / n for n in ("corpus/b.txt", "corpus/sub/c.txt", "corpus/a.md")]
    assert list(read_records(tmp_path / "corpus")) == [{"text": files[n]} for n in order]
    with pytest.raises(FileNotFoundError, match="nothing"):
        resolve_files(tmp_path / "nothing*.txt")
    data = load_tokenized(tmp_path / "corpus", BYTES, cache=False, progress=False)
    assert len(data) == 3 and "labels" not in data[0]
    for doc, name in zip(data, order, strict=True):  # one document per file, EOS-ended
        assert doc["input_ids"].tolist() == [*files[name].encode(), EOS]


def test_completion_and_chat_are_tokenized_with_their_labels(tmp_path, loaded):  # noqa: F811
    path = write_jsonl(tmp_path / "c.jsonl", RECORDS["completion"])
    data = load_tokenized(path, BYTES, cache=False, progress=False)
    for doc, record in zip(data, RECORDS["completion"], strict=True):
        prompt, completion = (record[k].encode() for k in ("prompt", "completion"))
        assert doc["input_ids"].tolist() == [*prompt, *completion, EOS]
        assert doc["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + [*completion, EOS]
    tok, _ = loaded["chatml"]
    chat = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"])
    data = load_tokenized(chat, tok, cache_dir=tmp_path / "cache", progress=False)
    for doc, record in zip(data, RECORDS["chat"], strict=True):
        want = encode_chat(tok, record["messages"])
        np.testing.assert_array_equal(doc["input_ids"], want["input_ids"])
        np.testing.assert_array_equal(doc["labels"], want["labels"])
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: chat records need an HFTokenizer"):
        load_tokenized(chat, BYTES, cache=False, progress=False)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: encode_chat: no assistant message"):
        load_tokenized(bad, tok, cache=False, progress=False)
    pref = write_jsonl(tmp_path / "p.jsonl", RECORDS["preference"])
    with pytest.raises(ValueError, match=r"p\.jsonl:2: chat records need an HFTokenizer"):
        load_tokenized(pref, BYTES, cache=False, progress=False)  # record 1 is strings: fine


def test_hf_datasets_from_local_json_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = RECORDS["completion"] * 3
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    hf_cache = tmp_path / "hf"
    for streaming in (False, True):
        source = hf_dataset("json", data_files=jsonl, streaming=streaming, cache_dir=hf_cache)
        assert list(read_records(source, format="completion")) == records
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "c.parquet"))
    source = hf_dataset("parquet", data_files=[tmp_path / "c.parquet"], cache_dir=hf_cache)
    assert list(read_records(source)) == records
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    saved = hf_dataset(tmp_path / "saved")
    assert list(read_records(saved)) == records
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p"}])
    with pytest.raises(ValueError, match=r"json\[train\]\[0\]: format 'completion' needs"):
        list(
            read_records(
                hf_dataset("json", data_files=bad, cache_dir=hf_cache), format="completion"
            )
        )
    ours = load_tokenized(jsonl, BYTES, cache=False, progress=False)
    theirs = load_tokenized(source, BYTES, cache=False, progress=False)
    assert all((a["labels"] == b["labels"]).all() for a, b in zip(ours, theirs, strict=True))


# --- the cache ----------------------------------------------------------------------------


def test_cache_hits_and_invalidates(tmp_path, capfd):
    path = write_jsonl(tmp_path / "t.jsonl", RECORDS["text"])
    cache = tmp_path / "cache"
    tok = CountingTokenizer()
    first = load_tokenized(path, tok, cache_dir=cache)
    assert tok.calls == 2 and "tokenizing" in capfd.readouterr().err  # progress on stderr
    again = load_tokenized(path, tok, cache_dir=cache)
    assert tok.calls == 2 and again.path == first.path  # a hit: the tokenizer is not called
    assert [d["input_ids"].tolist() for d in again] == [
        [*r["text"].encode(), EOS] for r in RECORDS["text"]
    ]
    assert "tokenizing" not in capfd.readouterr().err
    load_tokenized(path, tok, cache_dir=cache, add_eos=False)  # another option
    assert tok.calls == 4
    load_tokenized(path, CountingTokenizer("count/2"), cache_dir=cache)  # another tokenizer
    write_jsonl(path, RECORDS["text"][::-1])  # changed content (same size)
    changed = load_tokenized(path, tok, cache_dir=cache)
    assert tok.calls == 6 and changed.path != first.path
    assert changed[0]["input_ids"].tolist() == [*RECORDS["text"][1]["text"].encode(), EOS]
    meta = json.loads(changed.path.with_suffix(".json").read_text())
    assert meta["num_documents"] == 2 and meta["tokenizer_fingerprint"] == "count/1"
    assert tokenizer_fingerprint(BYTES) != tokenizer_fingerprint(CountingTokenizer())


def test_hf_tokenizer_fingerprints_differ_by_template(loaded):  # noqa: F811
    prints = {name: tokenizer_fingerprint(tok) for name, (tok, _) in loaded.items()}
    assert len(set(prints.values())) == len(prints)  # same BPE, different templates / specials
    assert tokenizer_fingerprint(loaded["chatml"][0]) == prints["chatml"]
    with pytest.raises(ValueError, match="fingerprint"):
        tokenizer_fingerprint(Unkeyed())


def test_a_killed_cache_write_is_never_read(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "t.jsonl", RECORDS["text"])
    cache = tmp_path / "cache"
    tok = CountingTokenizer()
    real_replace = os.replace

    def die_before_json(src, dst):
        if str(dst).endswith(".json"):
            raise KeyboardInterrupt  # killed between the arrays and the JSON
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", die_before_json)
    with pytest.raises(KeyboardInterrupt):
        load_tokenized(path, tok, cache_dir=cache, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not list(cache.glob("*.json")) and not list(cache.glob(".*tmp"))
    (arrays,) = cache.glob("*.safetensors")
    with pytest.raises(FileNotFoundError):
        TokenizedDataset.open(arrays)
    with pytest.warns(UserWarning, match="rebuilding the cache entry"):
        load_tokenized(path, tok, cache_dir=cache, progress=False)  # rebuilt, not read
    assert tok.calls == 4
    arrays.write_bytes(arrays.read_bytes()[:-8])  # a cut file beside its JSON
    with pytest.raises(Exception, match=r"."):
        TokenizedDataset.open(arrays)
    with pytest.warns(UserWarning, match="rebuilding the cache entry"):
        data = load_tokenized(path, tok, cache_dir=cache, progress=False)
    assert tok.calls == 6 and data[1]["input_ids"][-1] == EOS


def rewrite_entry(entry, change):
    """Apply ``change`` to the cache entry's arrays and record their new SHA-256 in its JSON,
    as a consistent writer would: only the checks of content can tell."""
    from safetensors.numpy import load_file, save_file

    arrays = load_file(entry)
    change(arrays)
    save_file(arrays, entry)
    meta_path = entry.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    digest = lambda a: "sha256:" + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    meta["checksums"] = {name: digest(a) for name, a in arrays.items()}
    meta_path.write_text(json.dumps(meta))


def assert_same_documents(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


@pytest.mark.parametrize("name", ["input_ids", "labels"])
def test_an_id_outside_the_vocabulary_is_rebuilt_not_served(tmp_path, name):
    path = write_jsonl(tmp_path / "c.jsonl", RECORDS["completion"])
    cache = tmp_path / "cache"
    fresh = load_tokenized(path, BYTES, cache=False, progress=False)
    entry = load_tokenized(path, BYTES, cache_dir=cache, progress=False).path
    assert fresh[0]["labels"][3] == IGNORE_INDEX  # -100 is a label, not an id out of range

    def poison(arrays):
        arrays[name][3] = BYTES.vocab_size  # same sizes, checksums updated

    rewrite_entry(entry, poison)
    why = f"{entry}: {name}[3] = 259 is outside the vocabulary [0, 259)"
    with pytest.warns(UserWarning, match=re.escape(why)):
        data = load_tokenized(path, BYTES, cache_dir=cache, progress=False)
    assert data.path == entry
    assert_same_documents(data, fresh)
    assert_same_documents(TokenizedDataset.open(entry), fresh)  # rebuilt on disk too


def test_a_flipped_bit_is_rebuilt_not_served(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", RECORDS["text"])
    cache = tmp_path / "cache"
    tok = CountingTokenizer()  # no vocab_size: only the checksum can tell
    entry = load_tokenized(path, tok, cache_dir=cache, progress=False).path
    raw = bytearray(entry.read_bytes())
    at = raw.index(b"h\0\0\0")  # the "h" of "hello", a little-endian int32 in input_ids
    raw[at] ^= 1  # "h" -> "i": still a byte, the same sizes
    entry.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=re.escape(f"{entry}: input_ids hashes to sha256:")):
        TokenizedDataset.open(entry)
    with pytest.warns(UserWarning, match=re.escape(f"{entry}: input_ids hashes to sha256:")):
        data = load_tokenized(path, tok, cache_dir=cache, progress=False)
    assert tok.calls == 4 and data.path == entry
    assert [d["input_ids"].tolist() for d in data] == [
        [*r["text"].encode(), EOS] for r in RECORDS["text"]
    ]


@pytest.mark.parametrize("failure", ["arrays: OSError", "arrays: SafetensorError", "json"])
def test_a_failed_cache_write_names_the_entry_and_goes_on_in_memory(tmp_path, monkeypatch, failure):
    import safetensors.numpy
    from safetensors import SafetensorError

    path = write_jsonl(tmp_path / "c.jsonl", RECORDS["completion"])
    cache = tmp_path / "cache"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failure == "json":
        real_replace = os.replace

        def replace(src, dst):
            if str(dst).endswith(".json"):
                raise full  # the arrays are in place, their JSON is not
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    else:

        def save_file(arrays, filename):
            with open(filename, "wb") as f:
                f.write(b"half a file")
            if failure == "arrays: OSError":
                raise full
            # what safetensors raises on a full disk: its message names no file
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" })'
            )

        monkeypatch.setattr(safetensors.numpy, "save_file", save_file)
    fresh = load_tokenized(path, BYTES, cache=False, progress=False)
    entry = re.escape(str(cache)) + r"/[0-9a-f]{32}\.safetensors"
    with pytest.warns(UserWarning, match=f"could not write the cache entry {entry} .*No space"):
        data = load_tokenized(path, BYTES, cache_dir=cache, progress=False)
    assert data.path is None
    assert_same_documents(data, fresh)
    assert list(cache.iterdir()) == []  # no temporary file, no partial entry


def test_ids_a_tokenizer_gives_outside_its_vocabulary_name_the_document(tmp_path):
    class SmallVocab(CountingTokenizer):
        vocab_size = 110  # "hi" fits, the "o" of "hello" (111) does not

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}, {"text": "hello"}])
    for cache in (False, True):
        with pytest.raises(ValueError, match=r"document 1 of .*t\.jsonl the input_ids 111, "):
            load_tokenized(path, SmallVocab(), cache=cache, add_eos=False, progress=False)


def test_an_entry_written_before_checksums_is_rebuilt_in_place(tmp_path):
    from safetensors.numpy import save_file

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}, {"text": "world!"}])
    # The entry edl wrote for this file before entries carried checksums (version 1): the
    # key is unchanged, so the rebuild replaces it rather than leaving it behind.
    entry = tmp_path / "cache" / "0d2f03d49ad02edd21ce46277a6edb28.safetensors"
    entry.parent.mkdir()
    ids = np.array([*b"hello", EOS, *b"world!", EOS], dtype=np.int32)
    save_file({"input_ids": ids, "offsets": np.array([0, 6, 13], dtype=np.int64)}, entry)
    old_meta = {
        "add_bos": False,
        "add_eos": True,
        "format": "auto",
        "formats": ["text"],
        "has_labels": False,
        "num_documents": 2,
        "num_tokens": 13,
        "source": str(path),
        "source_fingerprint": "ad545297713cd589eb87814b21332a76e1c11febc1d8fb8828f29852d9488640",
        "tokenizer": "bytes",
        "tokenizer_fingerprint": "edl.ByteTokenizer/1",
        "version": 1,
    }
    meta_path = entry.with_suffix(".json")
    meta_path.write_text(json.dumps(old_meta, indent=2, sort_keys=True) + "\n")
    why = "not an edl tokenized-dataset entry of version 2 (version 1; entries before 2 carry"
    with pytest.warns(UserWarning, match=re.escape(f"entry {entry}: {meta_path}: {why}")):
        data = load_tokenized(path, BYTES, cache_dir=tmp_path / "cache", progress=False)
    assert data.path == entry and sorted(entry.parent.iterdir()) == [meta_path, entry]
    meta = json.loads(meta_path.read_text())
    assert meta["version"] == 2 and sorted(meta["checksums"]) == ["input_ids", "offsets"]
    assert [d["input_ids"].tolist() for d in data] == [[*b"hello", EOS], [*b"world!", EOS]]


# --- SFT batches --------------------------------------------------------------------------


def examples(lengths, seed=0):
    """SFT examples of the given lengths: random ids, the first third of labels masked."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, 250, n).astype(np.int32)
        labels = np.where(np.arange(n) < n // 3, IGNORE_INDEX, ids).astype(np.int32)
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference_rows(docs, max_length):
    """Whole examples in order, a new row when the next does not fit; longer ones keep
    their last ``max_length`` tokens, alone in a row."""
    rows, row = [], []
    for d in docs:
        ids, labels = d["input_ids"][-max_length:], d["labels"][-max_length:]
        if row and sum(len(i) for i, _ in row) + len(ids) > max_length:
            rows.append(row)
            row = []
        row.append((ids, labels))
    return [*rows, row]


def reference_batch(rows, max_length):
    shape = (len(rows), max_length)
    out = {k: np.zeros(shape, np.int32) for k in ("attention_mask", "position_ids", "segment_ids")}
    out["input_ids"] = np.full(shape, PAD, np.int32)
    out["labels"] = np.full(shape, IGNORE_INDEX, np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, (ids, labels) in enumerate(row, start=1):
            for t in range(len(ids)):
                out["input_ids"][r, at] = ids[t]
                out["labels"][r, at] = labels[t]
                out["attention_mask"][r, at] = 1
                out["position_ids"][r, at] = t
                out["segment_ids"][r, at] = s
                at += 1
    return out


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert a[key].dtype == b[key].dtype == np.int32


def test_packed_sft_keeps_labels_and_examples_whole():
    docs = examples([5, 3, 7, 2, 9, 4, 1, 6])
    max_length, batch_size = 10, 2
    rows = reference_rows(docs, max_length)
    rows += [[]] * (-len(rows) % batch_size)
    want = reference_batch(rows, max_length)
    got = list(
        TokenBatches(
            docs, batch_size=batch_size, max_length=max_length, shuffle=False, repeat=False
        )
    )
    assert len(got) == len(rows) // batch_size
    for b, batch in enumerate(got):
        assert_batches_equal(batch, {k: v[b * 2 : b * 2 + 2] for k, v in want.items()})
    streamed = list(batches_from_iterable(iter(docs), batch_size=2, max_length=max_length))
    for a, b in zip(streamed, got, strict=True):
        assert_batches_equal(a, b)


def test_long_examples_are_truncated_counted_and_warned():
    docs = examples([4, 12, 3, 15])
    it = TokenBatches(docs, batch_size=4, max_length=8, shuffle=False, repeat=False)
    with pytest.warns(UserWarning, match=r"documents\[1\] has 12 tokens.*last 8"):
        (batch,) = list(it)
    assert it.truncated == 2
    want = reference_batch(reference_rows(docs, 8), 8)
    assert_batches_equal(batch, want)
    it = TokenBatches(docs[1:2], batch_size=1, max_length=8, truncation="keep_start", repeat=False)
    with pytest.warns(UserWarning, match="first 8"):
        np.testing.assert_array_equal(next(it)["labels"][0], docs[1]["labels"][:8])


def test_padded_sft_is_one_example_per_row():
    docs = examples([5, 3, 7])
    (batch,) = list(
        TokenBatches(docs, batch_size=4, max_length=8, pack=False, shuffle=False, repeat=False)
    )
    want = reference_batch([[(d["input_ids"], d["labels"])] for d in docs] + [[]], 8)
    assert_batches_equal(batch, want)


def test_labels_must_match_input_ids():
    docs = [*examples([3]), {"input_ids": [1, 2, 3], "labels": [1, 2]}]
    with pytest.raises(
        ValueError, match=r"documents\[1\]: 'labels' has 2 entries but 'input_ids' has 3"
    ):
        list(TokenBatches(docs, batch_size=1, max_length=4, shuffle=False, repeat=False))
    with pytest.raises(ValueError, match=r"documents\[0\]\['labels'\] holds label -5"):
        next(
            batches_from_iterable([{"input_ids": [1], "labels": [-5]}], batch_size=1, max_length=4)
        )
    with pytest.raises(ValueError, match=r"documents\[0\] has 'labels' but no 'input_ids'"):
        next(batches_from_iterable([{"text": "a", "labels": [1]}], batch_size=1, max_length=4))


# --- process split and resumption ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:documents.*more than max_length")
@pytest.mark.parametrize("pack", [True, False])
def test_processes_share_each_global_batch(pack):
    docs = [*examples([5, 3, 7, 2, 9, 4, 1, 6, 8, 2, 3]), "some text", [7, 8, 9]]
    kwargs = dict(batch_size=4, max_length=8, pack=pack, seed=3)
    whole = TokenBatches(docs, **kwargs)
    parts = [TokenBatches(docs, **kwargs, process_index=p, process_count=2) for p in range(2)]
    for _ in range(6):
        want = next(whole)
        got = [next(p) for p in parts]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])
        assert parts[0].position == parts[1].position == whole.position
    streams = [
        list(
            batches_from_iterable(
                docs, batch_size=4, max_length=8, pack=pack, process_index=p, process_count=4
            )
        )
        for p in range(4)
    ]
    single = list(batches_from_iterable(docs, batch_size=4, max_length=8, pack=pack))
    for b, want in enumerate(single):
        np.testing.assert_array_equal(
            np.concatenate([s[b]["labels"] for s in streams]), want["labels"]
        )
    with pytest.raises(ValueError, match=r"batch_size 4 .* divisible by process_count 3"):
        TokenBatches(docs, batch_size=4, max_length=8, process_count=3)
    with pytest.raises(ValueError, match="process_index"):
        batches_from_iterable(docs, batch_size=4, max_length=8, process_index=2, process_count=2)


def test_resume_from_a_cached_dataset_equals_the_uninterrupted_run(tmp_path):
    records = [
        {"prompt": f"q{i}: " + "x" * (i % 7), "completion": "y" * (i % 5)} for i in range(30)
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    data = load_tokenized(path, BYTES, cache_dir=tmp_path / "cache", progress=False)
    kwargs = dict(batch_size=2, max_length=24, seed=1)
    run = TokenBatches(data, **kwargs)
    expected = [next(run) for _ in range(20)]
    first = TokenBatches(data, **kwargs)
    [next(first) for _ in range(7)]
    saved = json.loads(json.dumps(first.position))
    reopened = load_tokenized(path, BYTES, cache_dir=tmp_path / "cache", progress=False)
    resumed = TokenBatches(reopened, **kwargs)
    resumed.restore(saved)
    for want in expected[7:]:
        assert_batches_equal(next(resumed), want)
    assert (np.concatenate([b["labels"] for b in expected]) != IGNORE_INDEX).any()


def test_source_is_a_plain_record_stream():
    source = Source("mem", "f", lambda: iter([("mem:1", {"text": "a"}), ("mem:2", {"tx": 1})]))
    with pytest.raises(ValueError, match="mem:2: format 'text' needs"):
        load_tokenized(source, BYTES, cache=False, progress=False)
    assert data_files is not None
