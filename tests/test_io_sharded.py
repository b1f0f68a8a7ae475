"""Sharded checkpoints (``edl.io.sharded`` through ``save_state(sharded=True)``): the pieces
each device holds are written once, and read back onto other meshes, or onto one device,
exactly. (Two processes writing one checkpoint: tests/test_sharding_multiprocess.py.)"""

import json

import jax
import numpy as np
import optax
import pytest
from test_io_checkpoint import LLAMA, _assert_same, _trained

import edl
from edl.io.checkpoint import load_state, save_state, verify_checkpoint
from edl.io.export import export_model
from edl.io.hf import save_pretrained
from edl.io.safetensors import CheckpointError, load_file
from edl.models import LlamaForCausalLM
from edl.sharding import make_mesh, shard_state


def _state(mesh_dims):
    tx = optax.adamw(1e-2)
    state = _trained(LlamaForCausalLM.init(LLAMA, key=jax.random.key(0)), tx)
    return state if mesh_dims is None else shard_state(state, None, make_mesh(mesh_dims))


def test_pieces_are_written_once_and_indexed(tmp_path):
    state = _state((2, 4, 1, 1))  # dp x fsdp: each array split 4 ways, replicated twice
    path = save_state(state, tmp_path, sharded=True)
    index = json.loads((path / "shards.json").read_text())
    stored = load_file(path / "model.process-00000.safetensors")
    embed = index["model"]["model.embed_tokens.weight"]
    assert embed["shape"] == [LLAMA.vocab_size, LLAMA.hidden_size]
    pieces = embed["pieces"]
    assert len(pieces) == len({tuple(p["start"]) for p in pieces})  # no region twice
    total = sum(np.prod(np.subtract(p["stop"], p["start"])) for p in pieces)
    assert total == LLAMA.vocab_size * LLAMA.hidden_size
    full = np.asarray(state.params.model.embed_tokens.weight)
    for p in pieces:
        block = tuple(slice(a, b) for a, b in zip(p["start"], p["stop"], strict=True))
        np.testing.assert_array_equal(stored[p["tensor"]], full[block])
    info = verify_checkpoint(path)
    assert info["model_format"] == "sharded" and info["model_files"] == ["model.process-00000"]


@pytest.mark.parametrize("target", [(1, 1, 8, 1), (8, 1, 1, 1), None])
def test_a_sharded_checkpoint_loads_onto_another_mesh_or_one_device(tmp_path, target):
    state = _state((2, 4, 1, 1))
    save_state(state, tmp_path, sharded=True, metadata={"position": 3})
    like = _state(target)
    loaded, metadata = load_state(tmp_path, like)
    _assert_same(loaded, state)
    assert metadata == {"position": 3}
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(like), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_an_unsharded_state_saves_sharded_and_bf16(tmp_path):
    state = _state(None)
    save_state(state, tmp_path, sharded=True, float_dtype="bfloat16")
    loaded, _ = load_state(tmp_path, state)
    weight = loaded.params.model.layers.mlp.down_proj.weight
    want = np.asarray(state.params.model.layers.mlp.down_proj.weight)
    np.testing.assert_array_equal(np.asarray(weight), want.astype("bfloat16").astype(want.dtype))
    _assert_same(loaded.opt_state, state.opt_state)  # the optimizer is never cast


def test_damaged_pieces_and_mismatched_targets_are_named(tmp_path):
    path = save_state(_state((1, 8, 1, 1)), tmp_path, sharded=True)
    smaller = edl.create_state(
        LlamaForCausalLM.init(LLAMA.replace(hidden_size=8, intermediate_size=16),
                              key=jax.random.key(0)), optax.adamw(1e-2))  # fmt: skip
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: expected \(64, 8\)"):
        load_state(tmp_path, smaller)
    file = path / "optimizer.process-00000.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"optimizer\.process-00000\.safetensors"):
        verify_checkpoint(path)


def test_a_sharded_checkpoint_exports_as_save_pretrained_writes_it(tmp_path):
    """``export_model`` streams a sharded checkpoint into HF files, tensor by tensor: the
    same tensors, names and config as ``save_pretrained`` of the model itself."""
    state = _state((2, 4, 1, 1))
    checkpoint = save_state(state, tmp_path / "run", sharded=True)
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    out = export_model(checkpoint, tmp_path / "export", dtype="bfloat16")
    expected = save_pretrained(edl.state.model(state), tmp_path / "direct", dtype="bfloat16")
    got, want = load_file(out / "model.safetensors"), load_file(expected / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (expected / "config.json").read_text()
    )
