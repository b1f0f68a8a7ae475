"""Sharded checkpoints (``edl.io.checkpoint.sharded`` through ``save_state(sharded=True)``):
the pieces each device holds are written once, and read back onto other meshes, or onto one device,
exactly; a damaged or hostile ``shards.json`` or a missing piece file is refused naming the
file and the entry. (Two processes writing one checkpoint:
tests/test_sharding_multiprocess.py.)"""

import copy
import functools
import json
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_io_checkpoint import LLAMA, _assert_same, _trained

import edl
from edl.io.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_state,
    save_state,
    verify_checkpoint,
)
from edl.io.export import export_model
from edl.io.formats.hf import save_pretrained
from edl.io.formats.safetensors import CheckpointError, load_file, save_file
from edl.models import LlamaForCausalLM
from edl.sharding import make_mesh, shard_state


@functools.cache  # one trained state for the file (immutable arrays; each training compiles)
def _trained_state():
    return _trained(LlamaForCausalLM.init(LLAMA, key=jax.random.key(0)), optax.adamw(1e-2))


def _state(mesh_dims):
    state = _trained_state()
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
        LlamaForCausalLM.init(
            LLAMA.replace(hidden_size=8, intermediate_size=16), key=jax.random.key(0)
        ),
        optax.adamw(1e-2),
    )
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


# -- shards.json validated; incomplete sharded checkpoints skipped -----------------------------


def _small(step=1):
    """A tiny state whose ``w`` (8, 4) is split in eight 2 x 2 blocks (``pieces[k]`` covers
    rows 2(k // 2).. and columns 2(k % 2)..) and whose ``b`` is replicated: cheap to save."""
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    params = {
        "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("a", "b"))),
        "b": jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh, PartitionSpec())),
    }
    return edl.create_state(params, optax.sgd(0.1, momentum=0.9), step=step)


def _edit_index(checkpoint, edit):
    index = json.loads((checkpoint / "shards.json").read_text())
    edit(index)
    (checkpoint / "shards.json").write_text(json.dumps(index))


def _w(index):
    return index["model"]["w"]["pieces"]


def _swap_names(index):
    a, b = _w(index)[0], _w(index)[1]
    a["tensor"], b["tensor"] = b["tensor"], a["tensor"]


def _shift(index):  # same volume as before, so only an overlap check notices
    _w(index)[1].update(start=[0, 1], stop=[2, 3], tensor="w@0:2,1:3")


_BAD_INDEXES = {
    "process_count missing": (
        lambda i: i.pop("process_count"),
        r"process_count: expected a positive integer, got None",
    ),
    "process_count a string": (
        lambda i: i.update(process_count="1"),
        r"process_count: expected a positive integer, got '1'",
    ),
    "process_count zero": (
        lambda i: i.update(process_count=0),
        r"process_count: expected a positive integer, got 0",
    ),
    "process out of range": (
        lambda i: _w(i)[3].update(process=1),
        r"model\['w'\]\.pieces\[3\]\.process: expected a process id in \[0, 1\) "
        r"\(process_count is 1\), got 1",
    ),
    "negative start": (
        lambda i: _w(i)[0].update(start=[-2, 0]),
        r"model\['w'\]\.pieces\[0\]\.start: expected 2 integers from \[0, 0\] to \[8, 4\], "
        r"got \[-2, 0\]",
    ),
    "start of the wrong rank": (
        lambda i: _w(i)[0].update(start=[0]),
        r"model\['w'\]\.pieces\[0\]\.start: expected 2 integers .*, got \[0\]",
    ),
    "stop past the end": (
        lambda i: _w(i)[7].update(stop=[9, 4]),
        r"model\['w'\]\.pieces\[7\]\.stop: expected 2 integers from \[6, 2\] to \[8, 4\], "
        r"got \[9, 4\]",
    ),
    "swapped names": (
        _swap_names,
        r"model\['w'\]\.pieces\[0\]\.tensor: expected 'w@0:2,0:2' .*, got 'w@0:2,2:4'",
    ),
    "overlap": (
        _shift,
        r"model\['w'\]\.pieces\[1\]: expected a block no other piece holds, got "
        r"\[0, 1\]\.\.\[2, 3\], which overlaps pieces\[0\]'s \[0, 0\]\.\.\[2, 2\]",
    ),
    "duplicate": (
        lambda i: _w(i).append(copy.deepcopy(_w(i)[5])),
        r"model\['w'\]\.pieces\[8\]: expected a block no other piece holds",
    ),
    "gap": (
        lambda i: _w(i).pop(),
        r"model\['w'\]\.pieces: expected pieces covering all 32 values of shape \[8, 4\], "
        r"got 28 values covered",
    ),
    "bad dtype": (
        lambda i: i["model"]["w"].update(dtype="float33"),
        r"model\['w'\]\.dtype: expected one of \[.*'float32'.*\], got 'float33'",
    ),
    "missing field": (
        lambda i: _w(i)[2].pop("tensor"),
        r"model\['w'\]\.pieces\[2\]: expected an object with the fields \['process', 'start', "
        r"'stop', 'tensor'\], got the fields \['process', 'start', 'stop'\]",
    ),
    "shape not a list": (
        lambda i: i["optimizer"]["0.trace.b"].update(shape="4"),
        r"optimizer\['0\.trace\.b'\]\.shape: expected a list of non-negative integers",
    ),
    "unknown section": (
        lambda i: i.update(extra={}),
        r"the top level: expected only the keys .*, got also \['extra'\]",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_INDEXES))
def test_a_bad_index_is_refused_naming_shards_json_and_the_entry(tmp_path, case):
    edit, message = _BAD_INDEXES[case]
    state = _small()
    path = save_state(state, tmp_path, sharded=True)
    _edit_index(path, edit)
    where = re.escape(str(path / "shards.json"))
    with pytest.raises(CheckpointError, match=f"^{where}: {message}"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=f"^{where}: {message}"):
        load_state(path, state)


def test_an_index_repeating_a_key_is_refused(tmp_path):
    """JSON keeps a repeated key's last value silently; edl never writes one, so a repeat in
    ``shards.json`` (an edited file) is refused, naming the key."""
    state = _small()
    path = save_state(state, tmp_path, sharded=True)
    index = path / "shards.json"
    index.write_text(index.read_text().replace("{", '{"process_count": 1,', 1))
    with pytest.raises(CheckpointError, match="holds the key 'process_count' twice"):
        verify_checkpoint(path)


def test_piece_headers_must_match_the_index(tmp_path):
    """The index and the piece files disagree (dtype here): verify and load name the file
    and the tensor, before any data is read."""
    state = _small()
    path = save_state(state, tmp_path, sharded=True)
    _edit_index(path, lambda i: i["model"]["w"].update(dtype="float16"))
    message = (
        r"model\.process-00000\.safetensors: tensor 'w@0:2,0:2' \(shards\.json's "
        r"model\['w'\]\.pieces\[0\]\): expected float16 \[2, 2\], got float32 \[2, 2\]"
    )
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=message):
        load_state(path, state)


def _spread_over_two_processes(checkpoint):
    """Rewrite a one-process sharded checkpoint as two processes would have written it:
    the odd pieces of every array in ``{kind}.process-00001.safetensors``."""
    index = json.loads((checkpoint / "shards.json").read_text())
    index["process_count"] = 2
    for kind in ("model", "optimizer"):
        stored = load_file(checkpoint, prefix=f"{kind}.process-00000")
        mine = {0: {}, 1: {}}
        for entry in index[kind].values():
            for k, piece in enumerate(entry["pieces"]):
                piece["process"] = k % 2
                mine[k % 2][piece["tensor"]] = stored[piece["tensor"]]
        for process, tensors in mine.items():
            save_file(tensors, checkpoint / f"{kind}.process-{process:05d}.safetensors")
    (checkpoint / "shards.json").write_text(json.dumps(index))


def test_a_two_process_checkpoint_with_a_piece_file_missing_is_skipped(tmp_path):
    """Two processes' files load into one; without one of them (or without ``shards.json``)
    the checkpoint is incomplete: listing skips it, ``verify_checkpoint`` names the file."""
    state = _small()
    first = save_state(state, tmp_path, sharded=True, keep=None)
    second = save_state(edl.state.replace(state, step=2), tmp_path, sharded=True, keep=None)
    _spread_over_two_processes(second)
    loaded, _ = load_state(tmp_path, state)
    _assert_same(loaded, edl.state.replace(state, step=loaded.step))
    assert int(loaded.step) == 2

    (second / "optimizer.process-00001.safetensors").unlink()
    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(CheckpointError, match=r"optimizer\.process-00001\.safetensors"):
        verify_checkpoint(second)
    assert int(load_state(tmp_path, state)[0].step) == 1


def test_a_checkpoint_without_its_index_is_skipped(tmp_path):
    state = _small()
    first = save_state(state, tmp_path, sharded=True, keep=None)
    second = save_state(edl.state.replace(state, step=2), tmp_path, sharded=True, keep=None)
    (second / "shards.json").unlink()
    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(CheckpointError, match=r"shards\.json: .*cannot be read"):
        verify_checkpoint(second)


def test_a_missing_piece_file_is_skipped_and_not_counted_toward_keep(tmp_path):
    """A damaged checkpoint (its ``state.json`` says complete, a file is gone) is neither
    loaded nor counted toward ``keep``, and is left on disk for repair."""
    state = _small()
    first = save_state(state, tmp_path, sharded=True, keep=None)
    second = save_state(edl.state.replace(state, step=2), tmp_path, sharded=True, keep=None)
    (second / "model.process-00000.safetensors").unlink()
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match=r"holds neither model\.process-00000\.safetensors"):
        verify_checkpoint(second)
    third = save_state(edl.state.replace(state, step=3), tmp_path, sharded=True, keep=2)
    assert list_checkpoints(tmp_path) == [first, third]
    assert second.is_dir()
