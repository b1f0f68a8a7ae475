"""Adapter-only checkpoints of LoRA / QLoRA runs (``save_state(..., base=)``,
``edl.io.checkpoint.adapter_only``, ``edl.io.formats.base_ref``): the adapters and a reference
to the base, found again and checked by hash wherever the checkpoint is loaded."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.io.checkpoint import load_state, save_state, verify_checkpoint
from edl.io.export import export_model, load_base, load_model
from edl.io.formats.base_ref import BaseReference, reference
from edl.lora import apply_lora, lora_trainable
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.quantize import QuantConfig
from tests.conftest import TINY_LLAMA

QLORA = dataclasses.asdict(QuantConfig("nf4", block_size=32))


def _base(directory):
    model = LlamaForCausalLM.init(LlamaConfig(**TINY_LLAMA), key=jax.random.key(0))
    edl.save_pretrained(model, directory)
    return directory


def _state(base_dir, quantization=None, key=1):
    """A LoRA train state on the base in ``base_dir`` with nonzero adapters, and its base
    reference."""
    base = load_base(base_dir, dtype=jnp.float32, quantization=quantization)
    model = apply_lora(base, rank=4, alpha=8, key=jax.random.key(key))
    model = edl.tree.named_map(lambda p, x: x + 0.01 if lora_trainable.search(p) else x, model)
    state = edl.create_state(model, optax.adam(1e-3), trainable=lora_trainable)
    return state, reference(base_dir, dtype=jnp.float32, quantization=quantization)


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))


@pytest.mark.parametrize("quantization", [None, QLORA], ids=["lora", "qlora"])
def test_adapter_only_checkpoint_holds_no_base_and_loads_exactly(tmp_path, quantization):
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir, quantization)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    full = save_state(state, tmp_path / "full")

    files = sorted(p.name for p in checkpoint.iterdir())
    assert files == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    info = verify_checkpoint(checkpoint)
    assert info["model_format"] == "adapter"
    stored = BaseReference.from_json(info["base"], where="test")
    assert stored == ref and stored.source == str(base_dir.resolve())
    assert stored.files == ("model.safetensors",) and stored.quantization == quantization
    peft = json.loads((checkpoint / "adapter_config.json").read_text())
    assert peft["base_model_name_or_path"] == str(base_dir.resolve())

    # Resume: a fresh state built from the same base (the QLoRA codes derived again) reads
    # the adapters and the optimizer state back bit for bit.
    fresh, same = _state(base_dir, quantization, key=2)
    loaded, _ = load_state(checkpoint, fresh, base=same)
    assert _equal(loaded, state)
    # The model alone: the base found by the reference, equal to the full layout's.
    assert _equal(load_model(checkpoint), load_model(full))
    assert _equal(load_model(checkpoint, dtype=jnp.bfloat16), load_model(full, dtype=jnp.bfloat16))
    # The export is the full Hugging Face layout, the same as the full checkpoint's.
    export_model(checkpoint, tmp_path / "export")
    export_model(full, tmp_path / "export-full")
    for name in ("model.safetensors", "adapter_model.safetensors"):
        a = edl.io.formats.safetensors.load_file(tmp_path / "export" / name)
        b = edl.io.formats.safetensors.load_file(tmp_path / "export-full" / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_load_state_refuses_no_base_or_another_base(tmp_path):
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    with pytest.raises(ValueError, match="holds LoRA adapters only, trained on base model"):
        load_state(checkpoint, state)
    other = dataclasses.replace(ref, sha256="0" * 64, source="/elsewhere")
    with pytest.raises(ValueError, match="refusing a different base") as e:
        load_state(checkpoint, state, base=other)
    assert ref.sha256 in str(e.value) and "0" * 64 in str(e.value)
    assert str(checkpoint / "state.json") in str(e.value)
    qlora = dataclasses.replace(ref, quantization=QLORA)
    with pytest.raises(ValueError, match="quantized as"):
        load_state(checkpoint, state, base=qlora)
    abstract = jax.eval_shape(lambda: state)
    with pytest.raises(ValueError, match="is abstract"):
        load_state(checkpoint, abstract, base=ref)


def test_a_tampered_base_is_refused_naming_both_hashes(tmp_path):
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    model = edl.from_pretrained(base_dir)
    w = model.model.norm.weight
    edl.save_pretrained(
        dataclasses.replace(
            model,
            model=dataclasses.replace(model.model, norm=type(model.model.norm)(w.at[0].add(1))),
        ),
        base_dir,
    )
    actual, _ = edl.io.formats.base_ref.hash_weights(base_dir)
    assert actual != ref.sha256
    with pytest.raises(ValueError, match="refusing a different base") as e:
        load_model(checkpoint)
    message = str(e.value)
    assert ref.sha256 in message and actual in message and str(base_dir.resolve()) in message
    assert str(checkpoint / "state.json") in message


def test_a_missing_base_fails_in_one_line_and_base_finds_a_copy(tmp_path):
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    want = load_model(checkpoint)
    moved = tmp_path / "moved"
    shutil.move(base_dir, moved)
    with pytest.raises(FileNotFoundError) as e:
        load_model(checkpoint)
    assert "\n" not in str(e.value) and str(base_dir.resolve()) in str(e.value)
    assert _equal(load_model(checkpoint, base=moved), want)  # same weights elsewhere


def test_a_stored_reference_is_data_checked_field_by_field(tmp_path, monkeypatch):
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    info = json.loads((checkpoint / "state.json").read_text())
    want = load_model(checkpoint)

    def rewrite(**base):
        (checkpoint / "state.json").write_text(
            json.dumps({**info, "base": {**info["base"], **base}})
        )

    # A relative path resolves against the checkpoint's directory, not the working one.
    rewrite(source="../../base")
    monkeypatch.chdir(tmp_path / "run")
    assert _equal(load_model(checkpoint), want)
    rewrite(sha256="not a hash")
    with pytest.raises(ValueError, match="base sha256 = 'not a hash'"):
        load_model(checkpoint)
    with pytest.raises(edl.io.formats.safetensors.CheckpointError, match="base sha256"):
        verify_checkpoint(checkpoint)
    # Neither a path nor a repo id; a repo id offline and not cached: one line each.
    rewrite(source="a/b/c")
    with pytest.raises(FileNotFoundError, match="neither an absolute path"):
        load_model(checkpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rewrite(source="nobody/no-such-base-model")
    with pytest.raises(FileNotFoundError, match="hub could not serve nobody/no-such-base-model"):
        load_model(checkpoint)


def test_save_state_with_base_refuses_arrays_no_base_holds(tmp_path, tiny_llama):
    ref = BaseReference("/base", "0" * 64)
    state = edl.create_state(tiny_llama, optax.sgd(1e-3))
    with pytest.raises(ValueError, match="has no LoRA layers"):
        save_state(state, tmp_path / "a", base=ref)
    lora = apply_lora(tiny_llama, rank=2, alpha=4, key=jax.random.key(0))
    state = edl.create_state(lora, optax.sgd(1e-3), trainable=r"lora_|norm")
    with pytest.raises(ValueError, match=r"params\.model\.layers\..*norm.* is trained too"):
        save_state(state, tmp_path / "b", base=ref)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_transformers_and_peft_load_the_adapter_only_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = np.arange(3, 13)[None]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = load_model(checkpoint)(jnp.asarray(ids, jnp.int32)).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def _disk_use(directory):
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _one_line_failure(argv, capsys):
    from edl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    return err


@pytest.mark.slow  # three LoRA runs of 5 / 2 steps on a 2-layer model, each compiling (~2 min)
def test_cli_lora_checkpoints_are_adapters_resume_exactly_and_generate_as_the_full_ones(
    tmp_path, capsys
):
    from edl.cli import main
    from edl.io.formats.safetensors import load_file
    from tests.test_finetune_readme import _build_model, _write_chats

    model, chat = tmp_path / "model", tmp_path / "chat.jsonl"
    _build_model(model, hidden_size=256, intermediate_size=512)
    _write_chats(chat)
    common = ["train", "--model", str(model), "--data", str(chat), "--format", "chat"]
    common += ["--lora-rank", "2"]
    common += ["--batch-size", "2", "--seq-len", "64", "--save-every", "1", "--keep", "0"]
    common += ["--warmup-steps", "0", "--learning-rate", "1e-2", "--steps", "5", "--no-progress"]
    adapters, full = tmp_path / "adapters", tmp_path / "full"
    main([*common, "--output-dir", str(adapters)])
    main([*common, "--save-base", "--output-dir", str(full)])
    capsys.readouterr()

    # Five checkpoints each; the adapter-only ones hold no base and under 10% of the disk.
    last = "checkpoints/checkpoint-00000005"
    assert len(list((adapters / "checkpoints").glob("checkpoint-*"))) == 5
    assert not list(adapters.rglob("model*.safetensors")) and not list(
        adapters.rglob("config.json")
    )
    assert (full / last / "model.safetensors").is_file()
    ratio = _disk_use(adapters / "checkpoints") / _disk_use(full / "checkpoints")
    assert ratio < 0.10, ratio
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(adapters / last / name), load_file(full / last / name)
        assert all(np.array_equal(a[k], b[k]) for k in a)

    # Resumed from step 3 (checkpoints 4 and 5 gone): bit-equal to the uninterrupted run.
    resumed = tmp_path / "resumed"
    shutil.copytree(adapters, resumed)
    for step in (4, 5):
        shutil.rmtree(resumed / f"checkpoints/checkpoint-{step:08d}")
    main([*common, "--resume", "--output-dir", str(resumed)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["start_step"] == 3
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(adapters / last / name), load_file(resumed / last / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    # generate / export / info from the adapter-only run equal the full layout's.
    prompt = ["--prompt", "What is", "--max-new-tokens", "8"]
    main(["generate", "--model", str(adapters), *prompt])
    text = capsys.readouterr().out
    main(["generate", "--model", str(full), *prompt])
    assert text.strip() and capsys.readouterr().out == text
    for run in (adapters, full):
        main(["export", str(run), str(tmp_path / f"export-{run.name}")])
    for name in ("model.safetensors", "adapter_model.safetensors"):
        a = load_file(tmp_path / "export-adapters" / name)
        b = load_file(tmp_path / "export-full" / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    main(["info", str(adapters)])
    assert '"model_format": "adapter"' in capsys.readouterr().out

    # A changed base is refused by generate and by resume; a missing one in one line.
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    shutil.copy(model / "model.safetensors", tmp_path / "saved.safetensors")
    edl.io.formats.safetensors.save_file(weights, model / "model.safetensors")
    err = _one_line_failure(["generate", "--model", str(adapters), *prompt], capsys)
    assert "refusing a different base" in err and str(adapters / last / "state.json") in err
    err = _one_line_failure(
        [*common, "--steps", "6", "--resume", "--output-dir", str(adapters)], capsys
    )
    assert "refusing a different base" in err
    shutil.move(model, tmp_path / "gone")
    err = _one_line_failure(["export", str(adapters), str(tmp_path / "x")], capsys)
    assert f"base model {model}" in err and "no such directory" in err


def test_a_sharded_adapter_only_save_writes_the_adapters_pieces_alone(tmp_path):
    from edl.io.checkpoint.sharded import StoredArrays

    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    checkpoint = save_state(state, tmp_path / "run", base=ref, sharded=True)
    info = verify_checkpoint(checkpoint)
    assert info["model_format"] == "sharded" and info["base"]["sha256"] == ref.sha256
    with StoredArrays(checkpoint, "model") as stored:
        assert stored.arrays and all(lora_trainable.search(p) for p in stored.arrays)
    fresh, same = _state(base_dir, key=2)
    loaded, _ = load_state(checkpoint, fresh, base=same)
    assert _equal(loaded, state)
    with pytest.raises(ValueError, match="refusing a different base"):
        load_state(checkpoint, fresh, base=dataclasses.replace(ref, sha256="1" * 64))


def test_an_adapter_only_checkpoint_as_the_base_of_another_run(tmp_path):
    """``edl train --model RUN`` continues a LoRA run from its merged weights: the new run's
    reference is to the first run's (adapter-only) checkpoint, found and checked in turn."""
    base_dir = _base(tmp_path / "base")
    state, ref = _state(base_dir)
    first = save_state(state, tmp_path / "first", base=ref)
    merged = load_base(first, dtype=jnp.float32)  # the first run's adapters merged
    assert _equal(merged, edl.lora.merge_lora(load_model(first)))
    second_ref = reference(first, dtype=jnp.float32)
    assert second_ref.files == ("adapter_model.safetensors",)
    model = apply_lora(merged, rank=2, alpha=4, key=jax.random.key(3))
    second = edl.create_state(model, optax.adam(1e-3), trainable=lora_trainable)
    checkpoint = save_state(second, tmp_path / "second", base=second_ref)
    assert _equal(load_model(checkpoint), edl.state.model(second))
