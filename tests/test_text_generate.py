"""Text in, text out, against transformers: tokenizer files in every edl output directory
(``save_pretrained``, ``train``'s checkpoints), ``generate_text`` / ``stream_text``, and
``export`` of LoRA and QLoRA checkpoints that transformers and PEFT load.

A byte-level BPE is trained here with the `tokenizers` library (as in test_text.py) and
given a ChatML template; the model is a random 2-layer Llama over its vocabulary. Every
expectation is transformers' (or PEFT's) answer on the files edl wrote.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import edl  # noqa: E402
from edl.generate import generate_text, stream_text  # noqa: E402
from edl.io.checkpoint import (  # noqa: E402
    latest_checkpoint,
    load_state,
    save_state,
    verify_checkpoint,
)
from edl.io.export import export_model, load_model  # noqa: E402
from edl.io.formats.hf import save_pretrained  # noqa: E402
from edl.io.formats.safetensors import CheckpointError  # noqa: E402
from edl.lora import apply_lora, lora_trainable, unwrap_lora  # noqa: E402
from edl.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from edl.quantize import QuantConfig, dequantize, quantize  # noqa: E402
from edl.text import ByteTokenizer, load_tokenizer  # noqa: E402
from edl.text.detokenize import IncrementalText  # noqa: E402
from edl.train import CheckpointConfig, LogConfig, RunConfig, make_train_step, train  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question.",
    "Grüße aus Köln: 東京 and naïve café",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A ChatML BPE tokenizer whose default encoding prepends ``<s>`` (as Llama's)."""
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
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def _model(vocab_size: int, eos: list[int] | None = None, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(seed))
    if eos is None:
        return model
    return dataclasses.replace(model, generation_config=(("eos_token_id", json.dumps(eos)),))


def _hf_greedy(directory: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy new tokens (its generation_config.json's EOS ends them)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=int),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_save_pretrained_writes_the_tokenizer_and_transformers_loads_both(tmp_path, tokenizer):
    model = _model(tokenizer.vocab_size, eos=[2])
    save_pretrained(model, tmp_path, tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Grüße, how are you?"
    assert ref(text)["input_ids"] == tokenizer.encode(text, add_bos=True)
    assert ref.chat_template == CHATML
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokenizer.encode(text, add_bos=True)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    got = np.asarray(model(jnp.asarray([ids])).logits)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # ByteTokenizer has no files to write: the directory is the model's alone.
    save_pretrained(model, tmp_path / "bytes", tokenizer=ByteTokenizer())
    assert not any("tokenizer" in p.name for p in (tmp_path / "bytes").iterdir())


# The plain prompt takes the same path but for the template (~20 s): slow set.
@pytest.mark.parametrize("kind", [pytest.param("plain", marks=pytest.mark.slow), "chat"])
def test_generate_text_equals_transformers_greedy(tmp_path, tokenizer, kind):
    prompt = "The quick brown fox"
    if kind == "chat":
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        kwargs = {"system": messages[0]["content"], "chat": True}
    else:
        ids = transformers.AutoTokenizer.from_pretrained(tokenizer.source)(prompt)["input_ids"]
        kwargs = {}
    model = _model(tokenizer.vocab_size)
    free = generate_text(model, tokenizer, prompt, max_new_tokens=12, **kwargs)
    # An EOS the model reaches: the text stops before it, as transformers stops there.
    plain = np.asarray(
        edl.generate.generate(model, jnp.asarray([ids]), max_new_tokens=12).sequences[0, len(ids) :]
    ).tolist()
    model = _model(tokenizer.vocab_size, eos=[2, plain[5]])
    save_pretrained(model, tmp_path, tokenizer=tokenizer)
    want = _hf_greedy(tmp_path, ids, 12)
    assert want[-1] == plain[5] and len(want) <= 6 and want == plain[: len(want)]
    text = generate_text(model, tokenizer, prompt, max_new_tokens=12, **kwargs)
    assert text == tokenizer.decode(want[:-1], skip_special_tokens=True)
    assert free == tokenizer.decode(plain, skip_special_tokens=True)
    assert text and free.startswith(text)
    pieces = list(stream_text(model, tokenizer, prompt, max_new_tokens=12, **kwargs))
    assert "".join(pieces) == text
    beams = generate_text(model, tokenizer, prompt, max_new_tokens=4, num_beams=2, **kwargs)
    assert isinstance(beams, str)


def test_incremental_text_holds_back_incomplete_characters(tokenizer):
    """The one incremental detokenizer (``stream_text`` and the server): pieces join to the
    text, none holds half a character, and they come as tokens arrive."""
    text = "Grüße aus Köln: 東京 and naïve café\nok 🚀 done"
    for tok, ids in [
        (ByteTokenizer(), ByteTokenizer().encode(text)),
        (tokenizer, tokenizer.encode(text)),
    ]:
        stream = IncrementalText(tok)
        pieces = [stream.push([i]) for i in ids] + [stream.end()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
        assert len([p for p in pieces if p]) > len(text) // 4  # released as it went


@pytest.mark.slow  # greedy and sampled byte-level decoding, streamed and not (~30 s)
def test_stream_text_with_the_byte_tokenizer_equals_generate_text():
    model = _model(ByteTokenizer.vocab_size, eos=[ByteTokenizer.eos_id], seed=3)
    tok = ByteTokenizer()
    text = generate_text(model, tok, "Köln ", max_new_tokens=24)
    assert "".join(stream_text(model, tok, "Köln ", max_new_tokens=24)) == text
    key = jax.random.key(7)
    sampled = generate_text(model, tok, "Köln ", max_new_tokens=24, temperature=0.8, key=key)
    assert (
        "".join(stream_text(model, tok, "Köln ", max_new_tokens=24, temperature=0.8, key=key))
        == sampled
    )
    with pytest.raises(ValueError, match="tokenizer bytes has no chat template"):
        generate_text(model, tok, "hi", chat=True)


def _lora_model(vocab_size: int, quantized: bool | str = False):
    base = _model(vocab_size, eos=[2])
    if quantized:
        base = quantize(base, QuantConfig("int8" if quantized is True else quantized))
    lora = apply_lora(base, rank=4, alpha=8, key=jax.random.key(1))
    b = lambda p, x: (
        jax.random.normal(jax.random.key(len(p)), x.shape, x.dtype) * 0.2
        if p.endswith("lora_B.weight")
        else x
    )
    return edl.tree.named_map(b, lora)


def _lm_batches():
    ids = np.random.default_rng(0).integers(3, 200, (64, 2, 9))
    return iter([{"input_ids": jnp.asarray(x)} for x in ids])


@pytest.mark.slow  # a LoRA train run, its checkpoint reloaded and exported (~55 s)
def test_train_checkpoints_hold_the_tokenizer_and_load_in_transformers(tmp_path, tokenizer):
    model = _lora_model(tokenizer.vocab_size)
    tx = optax.adam(1e-2)
    step = make_train_step(lambda m, b: m.compute_loss(b["input_ids"]), tx)
    state = edl.create_state(model, tx, trainable=lora_trainable)
    state, _ = train(
        state,
        step,
        _lm_batches(),
        RunConfig(
            steps=2,
            output_dir=tmp_path,
            checkpoint=CheckpointConfig(every=1),
            log=LogConfig(progress=False),
        ),
        tokenizer=tokenizer,
    )
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    info = json.loads((checkpoint / "state.json").read_text())
    assert "tokenizer.json" in info["tokenizer_files"]
    assert info["layers"]["model.layers.self_attn.q_proj"]["lora"]["rank"] == 4
    ref = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert ref("Hello world")["input_ids"] == tokenizer.encode("Hello world", add_bos=True)
    # The checkpoint loads back as the trained LoRA model, and exports to plain HF files.
    trained = edl.state.model(state)
    ids = jnp.asarray([tokenizer.encode("Hello world", add_bos=True)])
    np.testing.assert_array_equal(
        np.asarray(load_model(checkpoint)(ids).logits), np.asarray(trained(ids).logits)
    )
    for source in (checkpoint, export_model(checkpoint, tmp_path / "export", merge_lora=True)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
        with torch.no_grad():
            want = hf(torch.tensor(np.asarray(ids))).logits.numpy()
        np.testing.assert_allclose(np.asarray(trained(ids).logits), want, rtol=1e-4, atol=1e-4)
    out = tmp_path / "export"
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHATML


# Slow (both): a LoRA run's export reaching transformers is checked by default through the
# CLI (test_cli_export_of_a_lora_run_loads_in_transformers); these add PEFT's adapter layout
# and a quantized base.
@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True])
def test_export_merged_and_with_a_peft_adapter(tmp_path, tokenizer, quantized):
    peft = pytest.importorskip("peft")
    model = _lora_model(tokenizer.vocab_size, quantized)
    state = edl.create_state(model, optax.adam(1e-3), trainable=lora_trainable)
    checkpoint = save_state(state, tmp_path / "run", tokenizer=tokenizer)
    ids = tokenizer.encode("The quick brown fox", add_bos=True)
    want = np.asarray(model(jnp.asarray([ids])).logits)

    merged = export_model(checkpoint, tmp_path / "merged", merge_lora=True)
    assert not (merged / "adapter_config.json").exists() and (merged / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor([ids])).logits.numpy(), want, atol=1e-4)
    edl_tokens = generate_text(
        edl.from_pretrained(merged), load_tokenizer(merged), "The quick brown fox", max_new_tokens=8
    )
    hf_tokens = _hf_greedy(merged, ids, 8)
    eos = hf_tokens.index(2) if 2 in hf_tokens else len(hf_tokens)
    assert edl_tokens == tokenizer.decode(hf_tokens[:eos], skip_special_tokens=True)

    # Unmerged: the adapter beside the base, which transformers applies itself (peft).
    split = export_model(checkpoint, tmp_path / "split")
    assert (split / "adapter_config.json").is_file() and not (
        split / "quantized.safetensors"
    ).exists()
    with torch.no_grad():
        embedded = transformers.AutoModelForCausalLM.from_pretrained(split).eval()
        np.testing.assert_allclose(embedded(torch.tensor([ids])).logits.numpy(), want, atol=1e-4)
        # The adapter alone, on the base from elsewhere.
        base = unwrap_lora(dequantize(model) if quantized else model)
        save_pretrained(base, tmp_path / "base")
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        peft_model = peft.PeftModel.from_pretrained(base, split).eval()
        np.testing.assert_allclose(peft_model(torch.tensor([ids])).logits.numpy(), want, atol=1e-4)
    # An earlier export is replaced; any other non-empty directory is refused.
    assert export_model(checkpoint, split, merge_lora=True) == split
    assert not (split / "adapter_config.json").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'other'} is not empty"):
        export_model(checkpoint, tmp_path / "other")


# nf4 runs by default (QLoRA: dequantized base + codes); the float LoRA case is its subset.
@pytest.mark.parametrize("quantized", [pytest.param(False, marks=pytest.mark.slow), "nf4"])
def test_lora_checkpoint_loads_in_transformers_and_resumes_exactly(tmp_path, tokenizer, quantized):
    """A LoRA (QLoRA) checkpoint is the base under plain HF names with the PEFT adapter
    beside it, so transformers (with peft) loads the fine-tuned model from it as it is,
    while edl reads the exact state back (the quantized codes, not the dequantized copy)."""
    model = _lora_model(tokenizer.vocab_size, quantized)
    state = edl.create_state(model, optax.adam(1e-3), trainable=lora_trainable)
    checkpoint = save_state(state, tmp_path / "run", tokenizer=tokenizer)
    info = verify_checkpoint(checkpoint)
    assert info["model_files"] == ["model", "adapter_model"] + (["quantized"] if quantized else [])
    ids = tokenizer.encode("The quick brown fox", add_bos=True)
    want = np.asarray(model(jnp.asarray([ids])).logits)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor([ids])).logits.numpy(), want, atol=1e-4)
    loaded, _ = load_state(checkpoint, jax.eval_shape(lambda: state))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(loaded), jax.tree.leaves(state), strict=True
    ):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    np.testing.assert_array_equal(
        np.asarray(load_model(checkpoint)(jnp.asarray([ids])).logits), want
    )
    with pytest.warns(UserWarning, match="also holds a PEFT adapter"):
        edl.from_pretrained(checkpoint)  # the base alone, said so
    (checkpoint / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="adapter_model"):
        verify_checkpoint(checkpoint)


@pytest.mark.slow  # four CLI generations, each compiled (~50 s)
def test_cli_generate_streams_with_the_directory_tokenizer(tmp_path, tokenizer, capsys):
    from edl.cli import main

    model = _model(tokenizer.vocab_size, eos=[2])
    save_pretrained(model, tmp_path, tokenizer=tokenizer)
    main(["generate", "--model", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "8"])
    want = generate_text(model, tokenizer, "Hello", max_new_tokens=8)
    assert capsys.readouterr().out == "Hello" + want + "\n"
    (tmp_path / "prompt.txt").write_text("What is the capital?", encoding="utf-8")
    main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--prompt-file",
            str(tmp_path / "prompt.txt"),
            "--chat",
            "--system",
            "Be brief.",
            "--max-new-tokens",
            "8",
        ]
    )
    want = generate_text(
        model, tokenizer, "What is the capital?", chat=True, system="Be brief.", max_new_tokens=8
    )
    assert capsys.readouterr().out == want + "\n"
    main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--prompt",
            "Hi",
            "--num-beams",
            "2",
            "--max-new-tokens",
            "4",
            "--dtype",
            "bfloat16",
        ]
    )
    assert capsys.readouterr().out.startswith("Hi")
    main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--prompt",
            "Hi",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "20",
            "--max-new-tokens",
            "4",
            "--seed",
            "3",
        ]
    )
    want = generate_text(
        model,
        tokenizer,
        "Hi",
        max_new_tokens=4,
        temperature=0.9,
        top_p=0.9,
        top_k=20,
        key=jax.random.key(3),
    )
    assert capsys.readouterr().out == "Hi" + want + "\n"


def test_cli_export_of_a_lora_run_loads_in_transformers(tmp_path, tokenizer, capsys):
    from edl.cli import main

    model = _lora_model(tokenizer.vocab_size)
    state = edl.create_state(model, optax.adam(1e-3), trainable=lora_trainable)
    run = tmp_path / "run"
    save_state(state, run / "checkpoints", tokenizer=tokenizer)
    main(["export", str(run), str(tmp_path / "merged"), "--merge-lora"])
    assert f"to {tmp_path / 'merged'}" in capsys.readouterr().out
    main(["export", str(run), str(tmp_path / "split"), "--dtype", "float32"])
    assert (
        f"beside the base: {tmp_path / 'split' / 'adapter_config.json'}" in capsys.readouterr().out
    )
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt, add_bos=True)
    hf_tokens = _hf_greedy(tmp_path / "merged", ids, 8)
    eos = hf_tokens.index(2) if 2 in hf_tokens else len(hf_tokens)
    want = prompt + tokenizer.decode(hf_tokens[:eos], skip_special_tokens=True) + "\n"
    for source in (tmp_path / "merged", run):  # the export, and the LoRA checkpoint itself
        main(["generate", "--model", str(source), "--prompt", prompt, "--max-new-tokens", "8"])
        assert capsys.readouterr().out == want
    main(["info", str(run)])
    assert "checkpoint-00000000" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(run), str(tmp_path / "other")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'other'} is not empty" in err and len(err.splitlines()) == 1
