"""edl.text against transformers on tokenizers the test builds: ids, chat templates, SFT labels.

A byte-level BPE is trained here with the `tokenizers` library on a few sentences and saved
as transformers tokenizer directories with different chat templates; every expectation is
transformers' own answer on the same files (or TRL's rule, written out with transformers).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from edl.text import (  # noqa: E402
    IGNORE_INDEX,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_chat,
    encode_completion,
    load_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question.",
    "What is the capital of France? Paris is the capital.",
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln: 東京 and naïve café",
]

_CHATML_TURN = "<|im_start|>{{ m['role'] }}\n"
# ChatML; `{GEN}` / `{END}` become `{% generation %}` / `{% endgeneration %}` or nothing (the
# newline after them is an expression: transformers' Jinja drops one after a block tag).
CHATML = (
    "{% for m in messages %}"
    + _CHATML_TURN
    + "{% if m['role'] == 'assistant' %}{GEN}{{ m['content'] }}<|im_end|>{END}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_GENERATION = CHATML.replace("{GEN}", "{% generation %}").replace(
    "{END}", "{% endgeneration %}"
)
CHATML_PLAIN = CHATML.replace("{GEN}", "").replace("{END}", "")
# A default system prompt when the conversation has none (as Qwen2.5's template does).
CHATML_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}" + CHATML_PLAIN
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (system if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
# Earlier assistant turns lose their content (as reasoning templates drop past thinking).
_ASSISTANT_CONTENT = "{% if m['role'] == 'assistant' %}{{ m['content'] }}"
REWRITING = CHATML_PLAIN.replace(
    _ASSISTANT_CONTENT,
    "{% if m['role'] == 'assistant' %}"
    "{% if loop.last %}{{ m['content'] }}{% else %}(earlier){% endif %}",
)
assert _ASSISTANT_CONTENT in CHATML_PLAIN

# name: (template, special tokens, whether the post-processor prepends <s>)
TOKENIZERS = {
    "chatml_generation": (
        CHATML_GENERATION,
        dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>"),
        True,
    ),
    "chatml": (CHATML_PLAIN, dict(eos_token="<|im_end|>"), False),
    "chatml_system": (CHATML_SYSTEM, dict(eos_token="<|im_end|>"), False),
    "llama2": (LLAMA2, dict(bos_token="<s>", eos_token="</s>"), True),
    "rewriting": (REWRITING, dict(eos_token="<|im_end|>"), False),
}

CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
    ],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "Hello! How are you today?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "Grüße aus Köln"},
        {"role": "assistant", "content": "東京 and naïve café"},
        {"role": "user", "content": "The quick brown fox?"},
        {"role": "assistant", "content": "jumps over the lazy dog."},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """One transformers tokenizer directory per entry of ``TOKENIZERS``, all sharing one
    BPE trained here."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS * 4, trainer)
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for name, (template, special, adds_bos) in TOKENIZERS.items():
        tok = RawTokenizer.from_str(raw.to_str())
        if adds_bos:
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
            )
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
        fast.chat_template = template
        fast.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="module")
def loaded(tokenizer_dirs) -> dict[str, tuple[HFTokenizer, object]]:
    """``name: (edl's tokenizer, transformers' own AutoTokenizer)`` on the same files."""
    from transformers import AutoTokenizer

    return {
        name: (load_tokenizer(path), AutoTokenizer.from_pretrained(path))
        for name, path in tokenizer_dirs.items()
    }


TEXTS = [
    "Hello world",
    "  The quick brown fox\n\tjumps",
    "Grüße aus Köln: 東京 🚀",
    "an end </s> inside and <|im_end|> too",
    "",
]


def test_import_edl_and_edl_text_need_neither_transformers_nor_jax():
    code = (
        "import sys, edl, edl.text, edl.train, edl.train.text\n"
        "from edl.train import ByteTokenizer\n"
        "heavy = [m for m in ('transformers', 'tokenizers', 'jax', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_byte_tokenizer_moved_and_is_still_exported_by_train():
    import edl.train
    import edl.train.text
    from edl.text import tokenizer

    assert edl.train.ByteTokenizer is edl.train.text.ByteTokenizer is tokenizer.ByteTokenizer
    assert edl.train.text.Tokenizer is Tokenizer
    assert isinstance(ByteTokenizer(), Tokenizer)


@pytest.mark.parametrize("name", ["chatml_generation", "chatml", "llama2"])
def test_encode_decode_and_special_ids_match_transformers(loaded, name):
    tok, ref = loaded[name]
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(ref) == 400
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.adds_bos == TOKENIZERS[name][2]
    assert tok.pad_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)
    assert {SPECIALS.index(s) for s in SPECIALS} <= tok.special_ids
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        # add_bos=adds_bos is transformers' default encoding, the one the model trained on.
        assert tok.encode(text, add_bos=tok.adds_bos) == ref(text)["input_ids"], text
        framed = tok.encode(text, add_bos=tok.bos_id is not None, add_eos=True)
        assert framed == [*([tok.bos_id] if tok.bos_id is not None else []), *ids, tok.eos_id]
        for skip in (False, True):
            assert tok.decode(framed, skip_special_tokens=skip) == ref.decode(
                framed, skip_special_tokens=skip
            )
        assert tok.decode(np.asarray(ids, np.int64)) == text  # byte-level BPE round-trips


def test_missing_special_tokens_raise_and_pad_falls_back_to_eos(loaded):
    tok, ref = loaded["chatml"]  # no bos, no pad: as many chat models
    assert ref.pad_token_id is None and tok.pad_id == tok.eos_id == SPECIALS.index("<|im_end|>")
    with pytest.raises(ValueError, match="has no bos id"):
        tok.encode("hi", add_bos=True)
    with pytest.raises(ValueError, match=r"id 400 is outside the vocabulary \[0, 400\)"):
        tok.decode([1, 400])


def test_lone_surrogates_are_refused_alike(loaded):
    """A lone surrogate (JSON's "\\ud800") is no text: both tokenizers refuse it by name
    (the `tokenizers` library alone raises a bare TypeError)."""
    for tok in (ByteTokenizer(), loaded["chatml"][0]):
        message = (
            "encode: text has a lone surrogate U+D83D at character 5: not Unicode text "
            "(it has no UTF-8 encoding)"
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            tok.encode("caf\u00e9 \ud83d!")


@pytest.mark.parametrize("name", ["chatml_generation", "chatml", "chatml_system", "llama2"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(loaded, name, conversation, add_generation_prompt):
    tok, ref = loaded[name]
    messages = CONVERSATIONS[conversation]
    if add_generation_prompt:
        messages = messages[:-1]  # ends with the user: ask for the assistant's turn
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = ref.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ref.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    assert tok.render_chat(messages, **kwargs) == text
    assert tok.apply_chat_template(messages, **kwargs) == list(ids)
    assert tok.decode(ids) == text


def _labelled_runs(tok: HFTokenizer, example) -> list[str]:
    """The text of each run of labelled tokens, in order."""
    labels = example["labels"]
    assert labels.shape == example["input_ids"].shape and labels.dtype == np.int32
    on = labels != IGNORE_INDEX
    assert np.array_equal(labels[on], example["input_ids"][on])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], on.astype(np.int8), [0]])))
    starts, ends = edges[::2], edges[1::2]
    return [tok.decode(example["input_ids"][a:b]) for a, b in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_encode_chat_labels_are_transformers_assistant_mask(loaded, conversation):
    tok, ref = loaded["chatml_generation"]
    messages = CONVERSATIONS[conversation]
    out = ref.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    example = encode_chat(tok, messages)
    assert example["input_ids"].tolist() == list(out["input_ids"])
    expected = np.where(np.asarray(out["assistant_masks"]) == 1, out["input_ids"], IGNORE_INDEX)
    assert example["labels"].tolist() == expected.tolist()
    assert _labelled_runs(tok, example) == _chatml_answers(messages)


def _chatml_answers(messages) -> list[str]:
    """Each ChatML assistant turn's text and end token. A turn opening with whitespace also
    shows the header's newline: byte-level BPE makes one token of "\n" + leading spaces,
    and a token that straddles the turn's start is labelled (transformers' mask rule)."""
    return [
        ("\n" if m["content"][:1].isspace() else "") + m["content"] + "<|im_end|>"
        for m in messages
        if m["role"] == "assistant"
    ]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_encode_chat_by_prefixes_gives_the_generation_blocks_labels(loaded, conversation):
    """The same ChatML template without `{% generation %}`: the prefix renderings locate the
    same tokens as transformers' mask does with the blocks."""
    messages = CONVERSATIONS[conversation]
    with_blocks = encode_chat(loaded["chatml_generation"][0], messages)
    by_prefixes = encode_chat(loaded["chatml"][0], messages)
    assert by_prefixes["input_ids"].tolist() == with_blocks["input_ids"].tolist()
    assert by_prefixes["labels"].tolist() == with_blocks["labels"].tolist()


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", ["chatml_system", "llama2"])
def test_encode_chat_labels_decode_to_each_assistant_turn(loaded, conversation, name):
    tok, ref = loaded[name]
    messages = CONVERSATIONS[conversation]
    example = encode_chat(tok, messages)
    assert example["input_ids"].tolist() == list(ref.apply_chat_template(messages)["input_ids"])
    if name == "llama2":  # the assistant turn is " {content} </s>": no header to straddle
        answers = [f" {m['content']} </s>" for m in messages if m["role"] == "assistant"]
    else:
        answers = _chatml_answers(messages)
    assert _labelled_runs(tok, example) == answers


def test_encode_chat_errors_name_the_message(loaded):
    tok = loaded["chatml"][0]
    user = {"role": "user", "content": "Hello"}
    assistant = {"role": "assistant", "content": "Hello world"}
    with pytest.raises(ValueError, match="no assistant message"):
        encode_chat(tok, [user])
    with pytest.raises(ValueError, match="message 0 is an assistant message"):
        encode_chat(tok, [assistant, user, assistant])
    rewriting = loaded["rewriting"][0]
    encode_chat(rewriting, [user, assistant])  # one assistant turn: nothing is rewritten
    with pytest.raises(ValueError, match=r"messages\[:2\].*assistant message 1 cannot be located"):
        encode_chat(rewriting, [user, assistant, user, assistant])


def test_encode_chat_empty_assistant_turn_learns_its_end_token(loaded):
    tok = loaded["chatml"][0]
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]
    assert _labelled_runs(tok, encode_chat(tok, messages)) == ["<|im_end|>"]


def _trl_completion(ref, prompt: str, completion: str) -> list[int]:
    """TRL SFTTrainer's labels for a prompt / completion pair (``completion_only_loss``):
    EOS text appended unless present, both texts tokenized with the default special tokens,
    the prompt's token count masked."""
    if not completion.endswith(ref.eos_token):
        completion += ref.eos_token
    prompt_ids = ref(text=prompt)["input_ids"]
    ids = ref(text=prompt + completion)["input_ids"]
    return [IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids) :], ids


@pytest.mark.parametrize("name", ["chatml_generation", "chatml"])  # with and without BOS
@pytest.mark.parametrize(
    ("prompt", "completion"),
    [
        ("What is the capital of France?", " Paris is the capital."),
        ("Question: 2 + 2 =\nAnswer:", " 4</s>"),  # already ends with an EOS text (one model)
        ("Grüße", ""),
    ],
)
def test_encode_completion_follows_trl(loaded, name, prompt, completion):
    tok, ref = loaded[name]
    labels, ids = _trl_completion(ref, prompt, completion)
    example = encode_completion(tok, prompt, completion)
    assert example["input_ids"].tolist() == ids
    assert example["labels"].tolist() == labels
    assert example["input_ids"][-1] == tok.eos_id and example["labels"][-1] == tok.eos_id


def test_encode_completion_warns_when_a_token_spans_the_boundary(loaded):
    tok, ref = loaded["chatml"]
    prompt, completion = "The capital of France is ", "Paris"  # " Paris" is one token
    labels, ids = _trl_completion(ref, prompt, completion)
    with pytest.warns(UserWarning, match="not a prefix"):
        example = encode_completion(tok, prompt, completion)
    assert example["input_ids"].tolist() == ids and example["labels"].tolist() == labels


def test_encode_completion_on_the_byte_tokenizer():
    example = encode_completion(ByteTokenizer(), "ab", "cd")
    assert example["input_ids"].tolist() == [97, 98, 99, 100, 258]
    assert example["labels"].tolist() == [-100, -100, 99, 100, 258]
    bos = encode_completion(ByteTokenizer(), "ab", "cd", add_bos=True)
    assert bos["labels"].tolist() == [-100, -100, -100, 99, 100, 258]


def test_save_writes_only_text_files_that_transformers_reads_back(loaded, tmp_path):
    from transformers import AutoTokenizer

    tok, ref = loaded["chatml_generation"]
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    written = tok.save(out)
    names = sorted(p.name for p in written)
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert all(Path(n).suffix in {".json", ".jinja", ".txt"} for n in names), names
    assert sorted(p.name for p in out.iterdir()) == sorted({*names, "config.json"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left behind
    back = AutoTokenizer.from_pretrained(out)
    messages = CONVERSATIONS["multi_turn"]
    assert (
        back.apply_chat_template(messages)["input_ids"]
        == ref.apply_chat_template(messages)["input_ids"]
    )
    again = load_tokenizer(out)
    assert again.encode(TEXTS[2], add_bos=True) == tok.encode(TEXTS[2], add_bos=True)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)


def test_load_tokenizer_errors_name_the_path(tmp_path, tokenizer_dirs, monkeypatch):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model: no such file or directory"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no tokenizer files"):
        load_tokenizer(tmp_path)
    file = tmp_path / "tokenizer.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(file)
    monkeypatch.setitem(sys.modules, "transformers", None)  # the extra is not installed
    with pytest.raises(ImportError, match=r"pip install 'edl-jax\[text\]'"):
        load_tokenizer(tokenizer_dirs["chatml"])


def test_load_tokenizer_offline_repo_id_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(OSError, match="edl-test/no-such-repo"):
        load_tokenizer("edl-test/no-such-repo", local_files_only=True)


@pytest.mark.parametrize("with_template", [False, True], ids=["auto_map", "template"])
def test_tokenizer_files_run_no_code(tokenizer_dirs, tmp_path, with_template):
    """A tokenizer directory is data: an ``auto_map`` naming a tokenizer class in a ``.py``
    beside it is not imported (no ``trust_remote_code``), and a chat template cannot reach
    Python (transformers renders it in Jinja's sandbox)."""
    import shutil

    source = tmp_path / "tok"
    shutil.copytree(tokenizer_dirs["chatml"], source)
    marker = tmp_path / "ran"
    (source / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    if with_template:  # where transformers saved the template: a .jinja file or the config
        template = (
            "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ cycler.__init__.__globals__"
            ".os.system('touch " + str(marker) + "') }}"
        )
        if (source / "chat_template.jinja").is_file():
            (source / "chat_template.jinja").write_text(template)
        else:
            config["chat_template"] = template
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError):
        tokenizer = None  # refusing the directory is as good as not running its code
    if tokenizer is not None and with_template:
        from jinja2.exceptions import SecurityError, UndefinedError

        with pytest.raises((SecurityError, UndefinedError)):
            tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert not marker.exists()
