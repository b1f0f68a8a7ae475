"""edl.io.checkpoint: exact round trips, atomic saves, pruning, clear errors."""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import edl
from edl.io.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_state,
    save_state,
    verify_checkpoint,
)
from edl.io.formats.safetensors import CheckpointError, load_file
from edl.models import LlamaConfig, LlamaForCausalLM

LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _mlp(width=8, key=0, dtype=None):
    model = eqx.nn.MLP(4, 2, width, 2, key=jax.random.key(key))
    return model if dtype is None else edl.to_dtype(model, dtype)


def _trained(model, tx):
    """A state after one update, so Adam's count and moments are non-zero (synthetic
    gradients: a backward pass would only add compile time)."""

    @jax.jit
    def step(state):
        grads = jax.tree.map(lambda p: jnp.sin(p) * 0.5 + 0.01, state.params)
        return edl.apply_gradients(state, grads, tx)

    return step(edl.create_state(model, tx))


def _assert_same(a, b):
    fa, fb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(fa, fb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mlp_adamw_round_trip_is_bit_exact(tmp_path, dtype):
    tx = optax.adamw(1e-2)
    state = _trained(_mlp(dtype=dtype), tx)
    path = save_state(state, tmp_path, metadata={"data": {"epoch": 1, "offset": 17}})
    assert path == tmp_path / "checkpoint-00000001"
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    info = json.loads((path / "state.json").read_text())
    assert info["format"] == 1 and info["model_format"] == "tree" and info["has_optimizer"]
    assert set(load_file(path / "model.safetensors")) == {
        p for p, x in edl.tree.flatten(edl.state.model(state)).items() if edl.tree.is_array_like(x)
    }
    assert "0.count" in load_file(path, prefix="optimizer")

    like = edl.create_state(_mlp(key=1, dtype=dtype), tx)  # other values, same structure
    loaded, metadata = load_state(tmp_path, like)
    _assert_same(loaded, state)  # step, params, other's arrays and opt_state, bit for bit
    assert loaded.step.dtype == like.step.dtype and int(loaded.step) == 1
    assert metadata == {"data": {"epoch": 1, "offset": 17}}
    assert edl.state.model(loaded).activation is edl.state.model(like).activation


def test_llama_round_trip_and_from_pretrained(tmp_path):
    tx = optax.adamw(1e-3)
    state = _trained(LlamaForCausalLM.init(LLAMA, key=jax.random.key(0)), tx)
    key_data = jax.random.key_data(jax.random.key(7))
    path = save_state(state, tmp_path, metadata={"rng": key_data, "position": 3})
    assert json.loads((path / "state.json").read_text())["model_format"] == "hf"
    assert (path / "config.json").is_file()

    again = edl.from_pretrained(path)  # the checkpoint is a HF model directory too
    _assert_same(again, edl.state.model(state))

    like = edl.create_state(LlamaForCausalLM.init(LLAMA, key=jax.random.key(1)), tx)
    loaded, metadata = load_state(path, like)
    _assert_same(loaded, state)
    np.testing.assert_array_equal(np.asarray(metadata["rng"], np.uint32), key_data)
    assert metadata["position"] == 3


def test_float_dtype_stores_bf16_weights_and_f32_optimizer(tmp_path):
    tx = optax.adamw(1e-3)
    state = edl.create_state(LlamaForCausalLM.init(LLAMA, key=jax.random.key(0)), tx)
    path = save_state(state, tmp_path / "llama", float_dtype=jnp.bfloat16)
    assert {x.dtype for x in load_file(path).values()} == {np.dtype(jnp.bfloat16)}
    assert {x.dtype.name for x in load_file(path, prefix="optimizer").values()} == {
        "float32",
        "int32",
    }
    loaded, _ = load_state(path, state)  # cast back to like's float32
    want = edl.to_dtype(edl.to_dtype(state.params, jnp.bfloat16), jnp.float32)
    _assert_same(loaded.params, want)
    _assert_same(loaded.opt_state, state.opt_state)

    mlp = _trained(_mlp(), tx)
    path = save_state(mlp, tmp_path / "mlp", float_dtype=jnp.bfloat16)
    assert {x.dtype for x in load_file(path).values()} == {np.dtype(jnp.bfloat16)}
    assert "float32" in {x.dtype.name for x in load_file(path, prefix="optimizer").values()}


def test_sharded_like_places_loaded_arrays(tmp_path):
    tx = optax.adam(1e-2)
    state = _trained(_mlp(width=8), tx)
    save_state(state, tmp_path)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    like = jax.tree.map(
        lambda x: jax.device_put(x, sharding) if x.ndim and x.shape[0] % 8 == 0 else x,
        edl.create_state(_mlp(width=8, key=3), tx),
    )
    loaded, _ = load_state(tmp_path, like)
    _assert_same(loaded, state)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(like), strict=True):
        if y.ndim and y.shape[0] % 8 == 0:
            assert x.sharding == y.sharding


def test_keep_prunes_oldest_and_resave_replaces(tmp_path):
    state = edl.create_state(_mlp(), optax.sgd(0.1))
    for step in range(1, 6):
        save_state(edl.state.replace(state, step=step), tmp_path, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "checkpoint-00000004",
        "checkpoint-00000005",
    ]
    # Re-saving a step replaces it; the one just written survives even if it is not newest.
    save_state(edl.state.replace(state, step=4), tmp_path, keep=1, metadata={"again": True})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-00000004"]
    assert load_state(tmp_path, state)[1] == {"again": True}
    for step in (6, 7):
        save_state(edl.state.replace(state, step=step), tmp_path, keep=None)
    assert len(list_checkpoints(tmp_path)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        p.name for p in list_checkpoints(tmp_path)
    ]  # no temporary or set-aside directories remain
    with pytest.raises(ValueError, match="keep"):
        save_state(state, tmp_path, keep=0)


def test_incomplete_checkpoints_are_ignored_then_cleaned(tmp_path):
    tx = optax.adamw(1e-2)
    state = _trained(_mlp(), tx)
    good = save_state(state, tmp_path)
    broken = tmp_path / "checkpoint-00000009"  # a newer save killed before state.json
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    corrupt = tmp_path / "checkpoint-00000008"
    corrupt.mkdir()
    (corrupt / "state.json").write_text('{"step": 8, "form')
    stale = tmp_path / ".tmp-checkpoint-00000010-deadbeef"
    stale.mkdir()
    (stale / "optimizer.safetensors").write_bytes(b"partial")

    assert latest_checkpoint(tmp_path) == good
    assert list_checkpoints(tmp_path) == [good]
    loaded, _ = load_state(tmp_path, state)
    assert int(loaded.step) == 1

    newer = save_state(edl.state.replace(state, step=2), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name, newer.name]
    assert latest_checkpoint(tmp_path) == newer


def test_missing_directory_and_no_checkpoint(tmp_path):
    state = edl.create_state(_mlp(), optax.sgd(0.1))
    assert latest_checkpoint(tmp_path / "nope") is None
    assert list_checkpoints(tmp_path / "nope") == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state(tmp_path / "nope", state)
    (tmp_path / "checkpoint-00000001").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_state(tmp_path, state)


def test_mismatched_structure_names_paths_and_shapes(tmp_path):
    tx = optax.adamw(1e-2)
    save_state(_trained(_mlp(width=8), tx), tmp_path)
    with pytest.raises(ValueError, match=r"layers\.0\.weight: \(16, 4\) vs \(8, 4\)"):
        load_state(tmp_path, edl.create_state(_mlp(width=16), tx))
    with pytest.raises(ValueError, match=r"(?s)missing paths:.*1\.0\.mu\.layers\.0\.weight"):
        load_state(tmp_path, edl.create_state(_mlp(), optax.chain(optax.sgd(0.1), tx)))

    small = edl.create_state(LlamaForCausalLM.init(LLAMA, key=jax.random.key(0)), tx)
    save_state(small, tmp_path / "llama")
    wider, key = LLAMA.replace(hidden_size=32), jax.random.key(0)
    like = edl.create_state(edl.abstract(LlamaForCausalLM.init, wider, key=key))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: checkpoint \(64, 16\)"):
        load_state(tmp_path / "llama", like)
    with pytest.raises(ValueError, match="Hugging Face-layout model"):
        load_state(tmp_path / "llama", edl.create_state(_mlp(), tx))


def test_missing_optimizer(tmp_path):
    tx = optax.adamw(1e-2)
    state = _trained(_mlp(), tx)
    save_state(state, tmp_path, save_optimizer=False)
    like = edl.create_state(_mlp(key=1), tx)
    with pytest.raises(ValueError, match=r"no optimizer state(.|\n)*allow_missing_optimizer"):
        load_state(tmp_path, like)
    loaded, _ = load_state(tmp_path, like, allow_missing_optimizer=True)
    _assert_same(loaded.params, state.params)
    _assert_same(loaded.opt_state, like.opt_state)
    no_opt, _ = load_state(tmp_path, edl.create_state(_mlp(key=1)))  # like without optimizer
    assert no_opt.opt_state is None


def test_abstract_like(tmp_path):
    tx = optax.adamw(1e-2)
    state = _trained(_mlp(), tx)
    save_state(state, tmp_path)
    like = jax.eval_shape(lambda: edl.create_state(_mlp(), tx))
    loaded, _ = load_state(tmp_path, like)
    _assert_same(loaded, state)


def test_metadata_must_be_json(tmp_path):
    state = edl.create_state(_mlp(), optax.sgd(0.1))
    with pytest.raises(TypeError, match="metadata is not JSON-serialisable"):
        save_state(state, tmp_path, metadata={"f": object()})
    assert list(tmp_path.iterdir()) == []


_KILLED_WRITER = """
import os, signal, sys
import equinox as eqx, jax, optax
import edl
from edl.io.checkpoint import train_state as checkpoint

state = edl.create_state(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0)), optax.adam(1e-2))
checkpoint.save_state(state, sys.argv[1])
checkpoint.write_json_atomic = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # state.json
checkpoint.save_state(edl.state.replace(state, step=5), sys.argv[1])
"""


def test_killed_writer_leaves_previous_checkpoint_usable(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == ".tmp-checkpoint-00000005-" + names[0].rsplit("-", 1)[1]
    assert names[1:] == ["checkpoint-00000000"]
    state = edl.create_state(_mlp(key=1), optax.adam(1e-2))
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-00000000"
    assert int(load_state(tmp_path, state)[0].step) == 0
    save_state(edl.state.replace(state, step=1), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000000",
        "checkpoint-00000001",
    ]
    assert Path(tmp_path / "checkpoint-00000001" / "state.json").is_file()


_KILLED_RESAVE = """
import os, signal, sys
import equinox as eqx, jax, optax
import edl
from edl.io import checkpoint

state = edl.create_state(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0)), optax.adam(1e-2))
checkpoint.save_state(state, sys.argv[1], keep=1, metadata={"save": 1})
rename = os.replace

def killed_when_the_new_copy_moves_in(src, dst):
    if os.path.basename(src).startswith(".tmp-checkpoint-") and os.path.basename(
        dst
    ).startswith("checkpoint-"):
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(src, dst)

os.replace = killed_when_the_new_copy_moves_in
checkpoint.save_state(state, sys.argv[1], keep=1, metadata={"save": 2})
"""


def test_resaving_a_step_keeps_a_complete_checkpoint_at_every_instant(tmp_path):
    """Re-saving step 0 (the only checkpoint, keep=1), killed just before the new copy moves
    into place: step 0's previous checkpoint still loads, and later saves clean up."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_RESAVE), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    state = edl.create_state(_mlp(key=1), optax.adam(1e-2))
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "checkpoint-00000000.old"
    loaded, metadata = load_state(tmp_path, state)
    assert int(loaded.step) == 0 and metadata == {"save": 1}
    save_state(state, tmp_path, keep=1, metadata={"save": 3})  # step 0 again
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-00000000"]
    assert load_state(tmp_path, state)[1] == {"save": 3}
    save_state(edl.state.replace(state, step=1), tmp_path, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-00000001"]


def test_old_copy_is_superseded_once_the_new_one_is_complete(tmp_path):
    """A kill after the new copy moved in but before the old was deleted leaves both: the
    new one counts, and the next save removes the old."""
    state = edl.create_state(_mlp(), optax.sgd(0.1))
    save_state(state, tmp_path, metadata={"save": 1})
    shutil.copytree(tmp_path / "checkpoint-00000000", tmp_path / "checkpoint-00000000.old")
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-00000000"]
    save_state(edl.state.replace(state, step=1), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000000",
        "checkpoint-00000001",
    ]


def test_verify_checkpoint_names_the_damaged_file(tmp_path):
    state = _trained(_mlp(), optax.adamw(1e-2))
    path = save_state(state, tmp_path)
    assert verify_checkpoint(path)["step"] == 1
    model = path / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*bytes"):
        verify_checkpoint(path)
    (path / "optimizer.safetensors").unlink()
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds neither model\.safetensors"):
        verify_checkpoint(path)


def _escaping_checkpoint(tmp_path, how):
    """A checkpoint whose ``state.json`` names a file outside it; the outside file is a
    whole copy of its model file (so only the check can tell). Returns it and the entry."""
    path = save_state(edl.create_state(_mlp(), optax.sgd(0.1)), tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(path / "model.safetensors", outside / "model.safetensors")
    info = json.loads((path / "state.json").read_text())
    if how == "absolute":
        info["model_files"] = [str(outside / "model")]
    elif how == "dotdot":
        info["model_files"] = ["../../outside/model"]
    elif how == "symlink":
        (path / "model.safetensors").unlink()
        (path / "model.safetensors").symlink_to(outside / "model.safetensors")
    else:
        info["tokenizer_files"] = [str(outside / "model.safetensors")]
    (path / "state.json").write_text(json.dumps(info))
    return path, "tokenizer_files[0]" if how == "tokenizer" else "model_files[0]"


ESCAPES = ["absolute", "dotdot", "symlink", "tokenizer"]


@pytest.mark.parametrize("how", ESCAPES)
def test_verify_checkpoint_refuses_named_files_outside_it(tmp_path, how):
    path, entry = _escaping_checkpoint(tmp_path, how)
    with pytest.raises(CheckpointError, match=re.escape(f"{path / 'state.json'}: {entry}")):
        verify_checkpoint(path)


@pytest.mark.parametrize("how", ESCAPES)
def test_load_state_refuses_named_files_outside_it(tmp_path, how):
    path, entry = _escaping_checkpoint(tmp_path, how)
    with pytest.raises(ValueError, match=re.escape(f"{path / 'state.json'}: {entry}")):
        load_state(path, edl.create_state(_mlp(key=1), optax.sgd(0.1)))


def test_float_dtype_must_be_floating(tmp_path):
    state = edl.create_state(_mlp(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"float_dtype must be a floating dtype.*int32"):
        save_state(state, tmp_path, float_dtype=jnp.int32)
    assert list(tmp_path.iterdir()) == []
