"""edl.io.formats.safetensors: the format, interop with the official library and transformers,
sharding, streaming reads/writes and corruption reporting."""

import json
import os
import tempfile
import tracemalloc
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st
from jaxtyping import install_import_hook

with install_import_hook("edl", "beartype.beartype"):
    from edl.io.formats import safetensors as sf
    from edl.io.formats.safetensors import (
        CheckpointError,
        CheckpointReader,
        LazyTensor,
        MissingTensorError,
        load_file,
        open_checkpoint,
        parse_size,
        save_file,
        save_tensors,
    )

NUMPY_CODES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
ML_CODES = ["BF16", "F8_E4M3", "F8_E5M2"]
TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def random_array(code: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Arbitrary bit patterns of dtype ``code`` (bools are 0/1)."""
    dtype = sf.DTYPES[code]
    rng = np.random.default_rng(seed)
    if code == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (random floats include NaNs) plus equal dtype and shape."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def to_torch(arr: np.ndarray) -> torch.Tensor:
    code = sf.format._CODES[arr.dtype.name]
    if code in TORCH_DTYPES:
        ints = arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint8)
        return torch.from_numpy(ints.copy()).view(TORCH_DTYPES[code])
    return torch.from_numpy(arr.copy())


def from_torch(t: torch.Tensor) -> np.ndarray:
    for code, dt in TORCH_DTYPES.items():
        if t.dtype == dt:
            ints = t.view(torch.int16 if dt.itemsize == 2 else torch.uint8).numpy()
            return ints.view(sf.DTYPES[code])
    return t.numpy()


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    """A hand-made safetensors file (for corruption tests)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def f32(offsets: list[int], shape: list[int] | None = None) -> dict:
    return {"dtype": "F32", "shape": shape or [2], "data_offsets": offsets}


names = st.text("abcxyz._0123456789", min_size=1, max_size=10)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensor_dicts(draw, codes: list[str]) -> dict[str, np.ndarray]:
    keys = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    return {
        k: random_array(draw(st.sampled_from(codes)), draw(shapes), draw(st.integers(0, 2**31)))
        for k in keys
    }


# --------------------------------------------------------------------------------------------
# parse_size
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (123, 123),
        ("2GB", 2 * 10**9),
        ("500MB", 500 * 10**6),
        ("100KB", 100_000),
        ("2GiB", 2 * 2**30),
        ("5MiB", 5 * 2**20),
        ("3KiB", 3 * 2**10),
        ("1000", 1000),
        ("7B", 7),
        ("8Gb", 10**9),  # transformers: a lowercase "b" is bits
    ],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "GB", "2.5GB", "-1", "2 XB", "lots", -5])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError, match="size"):
        parse_size(size)


# --------------------------------------------------------------------------------------------
# Round trips and interop with the official library
# --------------------------------------------------------------------------------------------


@given(tensor_dicts(NUMPY_CODES + ML_CODES), st.integers(1, 64))
def test_round_trip(tensors, shard_size):
    with tempfile.TemporaryDirectory() as d:
        single = save_file(tensors, Path(d, "one.safetensors"))
        files = save_tensors(tensors, Path(d, "sharded"), max_shard_size=shard_size)
        for source in (single, Path(d, "sharded")):
            loaded = load_file(source)
            assert loaded.keys() == tensors.keys()
            for k, v in tensors.items():
                assert same(loaded[k], v), k
                assert loaded[k].flags.writeable
        with open_checkpoint(Path(d, "sharded")) as reader:
            assert reader.files == [f for f in files if f.suffix == ".safetensors"]
            assert reader.total_size == sum(v.nbytes for v in tensors.values())


@given(tensor_dicts(NUMPY_CODES))
def test_official_numpy_reads_ours(tensors):
    with tempfile.TemporaryDirectory() as d:
        path = save_file(tensors, Path(d, "x.safetensors"), metadata={"note": "hi"})
        theirs = safetensors.numpy.load_file(path)
        assert theirs.keys() == tensors.keys()
        for k, v in tensors.items():
            assert same(theirs[k], v), k
        with safetensors.safe_open(str(path), framework="np") as f:
            assert f.metadata() == {"format": "pt", "note": "hi"}


@given(tensor_dicts(NUMPY_CODES + ML_CODES))
def test_official_torch_reads_ours(tensors):
    with tempfile.TemporaryDirectory() as d:
        path = save_file(tensors, Path(d, "x.safetensors"))
        theirs = safetensors.torch.load_file(path)
        for k, v in tensors.items():
            assert same(from_torch(theirs[k]), v), k


@given(tensor_dicts(NUMPY_CODES))
def test_we_read_official_numpy(tensors):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "x.safetensors")
        safetensors.numpy.save_file(tensors, path, metadata={"a": "b"})
        with CheckpointReader(path) as reader:
            assert sorted(reader.keys()) == sorted(tensors)
            assert reader.metadata == {"a": "b"}
            for k, v in tensors.items():
                assert same(reader.read(k), v), k


@given(tensor_dicts(NUMPY_CODES + ML_CODES))
def test_we_read_official_torch(tensors):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "x.safetensors")
        safetensors.torch.save_file({k: to_torch(v) for k, v in tensors.items()}, path)
        loaded = load_file(path)
        for k, v in tensors.items():
            assert same(loaded[k], v), k


def test_official_reads_our_shards(tmp_path):
    tensors = {f"w{i}": random_array("F32", (4, 4), i) for i in range(5)}
    files = save_tensors(tensors, tmp_path, max_shard_size=150)
    index = json.loads(files[-1].read_text())
    for k, v in tensors.items():
        with safetensors.safe_open(str(tmp_path / index["weight_map"][k]), framework="np") as f:
            assert f.metadata() == {"format": "pt"}
            assert same(f.get_tensor(k), v)


def test_jax_and_big_endian_values(tmp_path):
    tensors = {
        "bf16": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "f32": jnp.ones((3,), jnp.float32),
        "be": np.arange(5, dtype=">i4"),
        "scalar": np.float16(1.5),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    loaded = load_file(tmp_path / "x.safetensors")
    assert same(loaded["bf16"], np.asarray(tensors["bf16"]))
    assert same(loaded["f32"], np.ones(3, np.float32))
    assert loaded["be"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(loaded["be"], np.arange(5))
    assert same(
        safetensors.numpy.load_file(tmp_path / "x.safetensors")["be"], np.arange(5, dtype="<i4")
    )
    assert loaded["scalar"].shape == ()


def test_unsupported_dtype_and_names(tmp_path):
    with pytest.raises(CheckpointError, match=r"'c'.*complex128"):
        save_file({"c": np.zeros(2, np.complex128)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="non-empty"):
        save_file({"": np.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="reserved"):
        save_file({"__metadata__": np.zeros(2)}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Sharding and the reader
# --------------------------------------------------------------------------------------------


def layered(n: int = 6) -> dict[str, np.ndarray]:
    """``n`` 400-byte tensors with distinct contents."""
    return {f"layers.{i}.w": np.full((10, 10), i, np.float32) for i in range(n)}


def test_sharding_layout(tmp_path):
    tensors = layered()
    files = save_tensors(tensors, tmp_path, max_shard_size=1000)  # two tensors per shard
    names = [f.name for f in files]
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 400
    assert list(index["weight_map"]) == sorted(tensors)
    assert index["weight_map"]["layers.0.w"] == index["weight_map"]["layers.1.w"] == names[0]
    assert index["weight_map"]["layers.5.w"] == names[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no temp files left

    save_file(tensors, tmp_path / "single" / "model.safetensors")
    with open_checkpoint(tmp_path) as sharded, open_checkpoint(tmp_path / "single") as single:
        assert len(sharded) == len(single) == 6
        assert sharded.keys() == list(tensors)
        for k in tensors:
            assert same(sharded.read(k), single.read(k))
            assert "layers.0.w" in sharded
        assert sharded.info("layers.3.w").file.name == names[1]
    # The index path itself and a single shard path open too.
    assert len(CheckpointReader(tmp_path / "model.safetensors.index.json")) == 6
    assert CheckpointReader.open(tmp_path / names[0]).keys() == ["layers.0.w", "layers.1.w"]


def test_resave_removes_stale_files(tmp_path):
    save_tensors(layered(), tmp_path, max_shard_size=1000)
    keep = ["other.safetensors", "model-extra.safetensors", "notes.txt", "adapter.safetensors"]
    for name in keep:
        (tmp_path / name).write_text("x")
    files = save_tensors(layered(4), tmp_path, max_shard_size=1000)
    assert [f.name for f in files][-1] == "model.safetensors.index.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f.name for f in files] + keep)
    files = save_tensors(layered(4), tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.safetensors", *keep])
    assert len(load_file(tmp_path)) == 4


def test_oversized_tensor_gets_own_shard(tmp_path):
    tensors = {
        "a": np.zeros(10, np.float32),
        "big": np.zeros(100, np.float32),
        "b": np.zeros(10, np.float32),
        "c": np.zeros(10, np.float32),
    }
    files = save_tensors(tensors, tmp_path, max_shard_size=100)
    wm = json.loads(files[-1].read_text())["weight_map"]
    assert len(files) == 4
    assert wm["a"] != wm["big"] != wm["b"]
    assert wm["b"] == wm["c"]
    assert [k for k, f in wm.items() if f == wm["big"]] == ["big"]


def test_prefix_and_metadata(tmp_path):
    save_tensors(layered(2), tmp_path, prefix="adapter", metadata={"step": "7"})
    assert (tmp_path / "adapter.safetensors").is_file()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors"):
        open_checkpoint(tmp_path)
    with open_checkpoint(tmp_path, prefix="adapter") as reader:
        assert reader.metadata == {"format": "pt", "step": "7"}
    save_file(layered(1), tmp_path / "np.safetensors", metadata={"format": "np"})
    assert CheckpointReader(tmp_path / "np.safetensors").metadata == {"format": "np"}


def test_read_into_slices_and_casts(tmp_path):
    tensors = {
        "bf16": random_array("F32", (3, 5), 0).clip(-10, 10).astype(ml_dtypes.bfloat16),
        "f32": np.arange(15, dtype=np.float32).reshape(3, 5),
    }
    save_tensors(tensors, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        stacked = np.zeros((4, 3, 5), np.float32)
        out = reader.read_into("bf16", stacked[3])  # cast bf16 -> f32
        assert np.shares_memory(out, stacked)
        np.testing.assert_array_equal(stacked[3], tensors["bf16"].astype(np.float32))
        reader.read_into("f32", stacked[1])  # same dtype: straight into the buffer
        np.testing.assert_array_equal(stacked[1], tensors["f32"])
        assert not stacked[0].any() and not stacked[2].any()
        strided = np.zeros((3, 2, 5), ml_dtypes.bfloat16)
        reader.read_into("f32", strided[:, 1])  # non-contiguous, cast f32 -> bf16
        np.testing.assert_array_equal(strided[:, 1].astype(np.float32), tensors["f32"])
        with pytest.raises(CheckpointError, match=r"'f32'.*\(3, 5\).*\(5, 3\)"):
            reader.read_into("f32", np.zeros((5, 3), np.float32))
        with pytest.raises(CheckpointError, match="read-only"):
            reader.read_into("f32", np.broadcast_to(np.float32(0), (3, 5)))


def test_missing_key_suggests_close_names(tmp_path):
    save_tensors(layered(3), tmp_path)
    with open_checkpoint(tmp_path) as reader:
        with pytest.raises(MissingTensorError, match=r"'layers\.9\.w'.*'layers\.\d\.w'") as e:
            reader.read("layers.9.w")
        assert isinstance(e.value, KeyError) and isinstance(e.value, CheckpointError)
        assert "model.safetensors" in str(e.value)
        with pytest.raises(KeyError):
            reader.info("zzz")


def test_threaded_reads_and_close(tmp_path):
    tensors = layered(8)
    save_tensors(tensors, tmp_path, max_shard_size=1200)
    reader = open_checkpoint(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(tensors, pool.map(reader.read, list(tensors) * 3), strict=False))
    for k, v in tensors.items():
        assert same(results[k], v)
    reader.close()
    reader.close()
    with pytest.raises(CheckpointError, match="closed"):
        reader.read("layers.0.w")


# --------------------------------------------------------------------------------------------
# Streaming writes: LazyTensor, one tensor alive at a time, atomicity
# --------------------------------------------------------------------------------------------


def test_lazy_tensors_load_once_one_at_a_time(tmp_path):
    stacked = np.arange(4 * 6, dtype=np.float32).reshape(4, 2, 3)
    calls: list[int] = []
    alive: set[int] = set()

    def loader(i: int):
        def load() -> np.ndarray:
            assert not alive, f"layer {i} loaded while {alive} still alive"
            calls.append(i)
            arr = stacked[i].copy()
            alive.add(i)
            weakref.finalize(arr, alive.discard, i)
            return arr

        return load

    tensors = {f"layers.{i}.w": LazyTensor([2, 3], "float32", loader(i)) for i in range(4)}
    assert tensors["layers.0.w"].shape == (2, 3)
    assert tensors["layers.0.w"].dtype == np.dtype(np.float32)
    assert calls == []
    save_tensors(tensors, tmp_path, max_shard_size=48)
    assert sorted(calls) == [0, 1, 2, 3]
    with open_checkpoint(tmp_path) as reader:
        assert len(reader.files) == 2
        for i in range(4):
            assert same(reader.read(f"layers.{i}.w"), stacked[i])


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.zeros((3, 2), np.float32), r"'bad'.*\(2, 3\).*\(3, 2\)"),
        (np.zeros((2, 3), np.float16), r"'bad'.*float32.*float16"),
    ],
)
def test_lazy_tensor_mismatch_raises_and_keeps_old_file(tmp_path, value, match):
    save_tensors({"old": np.ones(2, np.float32)}, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    bad = {"ok": np.zeros(3, np.float32), "bad": LazyTensor((2, 3), np.float32, lambda: value)}
    with pytest.raises(CheckpointError, match=match):
        save_tensors(bad, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_failing_loader_leaves_no_temp_files(tmp_path):
    def boom() -> np.ndarray:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_file({"x": LazyTensor((1,), np.int8, boom)}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# transformers loads what we save
# --------------------------------------------------------------------------------------------


def test_transformers_loads_sharded_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {
        k: v.detach().numpy() for k, v in state.items() if not (tied and k == "lm_head.weight")
    }
    files = save_tensors(tensors, tmp_path, max_shard_size="4KB")
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    config.to_json_file(tmp_path / "config.json")

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(loaded_state[k], v), k
    # And our reader sees exactly the state dict we wrote.
    with open_checkpoint(tmp_path) as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        np.testing.assert_array_equal(
            reader.read("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"]
        )


# --------------------------------------------------------------------------------------------
# Corruption is reported with the file and the tensor
# --------------------------------------------------------------------------------------------


def expect_error(path: Path, *fragments: str, open_path: Path | None = None):
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(open_path or path)
    message = str(e.value)
    assert path.name in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_truncated_file(tmp_path):
    path = save_file(
        {"a": np.zeros(4, np.float32), "last": np.zeros(8)}, tmp_path / "t.safetensors"
    )
    path.write_bytes(path.read_bytes()[:-3])
    expect_error(path, "truncated", "'a'")  # 'a' (f32) is stored after 'last' (f64)


def test_trailing_bytes(tmp_path):
    path = save_file({"a": np.zeros(4, np.float32)}, tmp_path / "t.safetensors")
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    expect_error(path, "4 unexpected bytes after tensor 'a'")


@pytest.mark.parametrize(
    ("length", "fragment"),
    [(2**62, "exceeds"), (10_000, "runs past the end")],
)
def test_garbled_header_length(tmp_path, length, fragment):
    path = write_raw(tmp_path / "h.safetensors", {"a": f32([0, 8])}, bytes(8), length=length)
    expect_error(path, fragment, str(length))


def test_too_short_file(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"\1\2\3")
    expect_error(path, "too few")


@pytest.mark.parametrize(
    ("header", "fragments"),
    [
        (b'{"a": {"dtype": ', ["not valid UTF-8 JSON"]),
        (b"\xff\xfe{}", ["not valid UTF-8 JSON"]),
        (b"[1, 2]", ["must be a JSON object", "list"]),
        ({"a": {"dtype": "F17", "shape": [2], "data_offsets": [0, 8]}}, ["'a'", "'F17'"]),
        ({"a": f32([0, 12])}, ["'a'", "need 8 bytes", "span 12"]),
        ({"a": f32([0, 8], [-1])}, ["'a'", "shape"]),
        ({"a": f32([8, 0])}, ["'a'", "data_offsets"]),
        ({"a": f32([0, 8]), "b": f32([4, 12])}, ["'b'", "overlaps tensor 'a'"]),
        ({"a": f32([0, 8]), "b": f32([12, 20])}, ["'b'", "hole of 4 bytes after tensor 'a'"]),
        ({"a": f32([0, 8]), "b": f32([8, 16])}, ["'b'", "truncated", "ends at byte"]),
        ({"a": [1, 2]}, ["'a'", "entry must be a JSON object"]),
        ({"__metadata__": {"k": 1}, "a": f32([0, 8])}, ["__metadata__"]),
        (
            b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}',
            ["'a'", "twice"],
        ),
    ],
)
def test_bad_header(tmp_path, header, fragments):
    path = write_raw(tmp_path / "bad.safetensors", header, bytes(8))
    expect_error(path, *fragments)


def sharded(tmp_path: Path) -> dict:
    save_tensors(layered(4), tmp_path, max_shard_size=800)
    return json.loads((tmp_path / "model.safetensors.index.json").read_text())


def test_index_missing_shard(tmp_path):
    index = sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert index["weight_map"]["layers.2.w"] == "model-00002-of-00002.safetensors"
    message = expect_error(
        tmp_path / "model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"
    )
    assert "'layers.2.w'" in message


def test_index_key_not_in_shard(tmp_path):
    index = sharded(tmp_path)
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(tmp_path / "model.safetensors.index.json", "'ghost'", "model-00001-of-00002")
    # Listed in the wrong shard: both names appear.
    index = sharded(tmp_path)
    index["weight_map"]["layers.0.w"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(tmp_path / "model.safetensors.index.json", "'layers.0.w'", "00001-of-00002")


def test_index_key_in_two_shards(tmp_path):
    save_file({"w": np.zeros(2, np.float32)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file(
        {"w": np.ones(2, np.float32), "x": np.ones(2, np.float32)},
        tmp_path / "model-00002-of-00002.safetensors",
    )
    index = {
        "metadata": {"total_size": 24},
        "weight_map": {
            "w": "model-00001-of-00002.safetensors",
            "x": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    message = expect_error(tmp_path / "model.safetensors.index.json", "'w'", "two shards")
    assert "model-00001-of-00002" in message and "model-00002-of-00002" in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"metadata": {}}', "weight_map"),
        ('{"weight_map": {"w": "../model-00001-of-00002.safetensors"}}', "'w'"),
        ('{"weight_map": {"w": 3}}', "'w'"),
    ],
)
def test_bad_index(tmp_path, text, fragment):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    expect_error(path, fragment, open_path=tmp_path)


def test_index_shard_linked_out_of_its_directory_is_refused(tmp_path):
    """A shard the index names that is a symlink leading out of the index's directory (here
    to a valid safetensors file elsewhere, which would otherwise load as the weights) is
    refused, naming the index and the entry; nothing outside is opened as a shard."""
    model = tmp_path / "model"
    sharded(model)
    outside = tmp_path / "elsewhere.safetensors"
    save_file({f"layers.{i}.w": np.zeros((10, 10), np.float32) for i in (2, 3)}, outside)
    shard = model / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(outside)
    index = model / "model.safetensors.index.json"
    message = expect_error(index, "weight_map['layers.2.w']", "outside", open_path=model)
    assert str(outside) in message


def test_index_in_a_hugging_face_cache_snapshot_reads(tmp_path):
    """The Hugging Face cache links every file of ``snapshots/<rev>/`` to ``blobs/``: the
    shards resolve beside the file the index links to, which is allowed."""
    files = save_tensors(layered(4), tmp_path / "blobs", max_shard_size=800)
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(files):  # blobs are named by hash, not by file name
        file.rename(tmp_path / "blobs" / f"{i:064x}")
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / f"{i:064x}")
    with open_checkpoint(snapshot) as reader:
        assert len(reader) == 4
        np.testing.assert_array_equal(reader.read("layers.3.w"), np.full((10, 10), 3.0))


def test_corruption_in_a_shard_names_the_shard(tmp_path):
    sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    expect_error(shard, "truncated", "'layers.3.w'", open_path=tmp_path)


def test_missing_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        CheckpointReader(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path)


def test_truncated_after_open(tmp_path):
    path = save_file({"a": np.zeros(1000, np.float32)}, tmp_path / "t.safetensors")
    with CheckpointReader(path) as reader:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        with pytest.raises(CheckpointError, match=r"t\.safetensors.*'a'"):
            reader.read("a")


# --------------------------------------------------------------------------------------------
# What the official library does not give (why edl keeps its own; see edl.io.formats.safetensors).
# Each test shows the library's behaviour next to ours, so it fails if either changes.
# --------------------------------------------------------------------------------------------


def traced_peak(fn) -> int:
    """Peak bytes allocated (numpy arrays included) while ``fn()`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_library_cannot_read_into_a_buffer(tmp_path):
    w = random_array("F32", (256, 1024), 0)  # 1 MiB
    path = save_file({"w": w}, tmp_path / "w.safetensors")
    stacked = np.zeros((2, *w.shape), np.float32)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.get_tensor("w") is not f.get_tensor("w")  # a fresh array per call
        peak = traced_peak(lambda: np.copyto(stacked[0], f.get_tensor("w")))
    assert peak >= w.nbytes, peak  # a transient copy of the whole tensor
    with CheckpointReader(path) as reader:
        out = stacked[1]
        peak = traced_peak(lambda: reader.read_into("w", out))
        assert reader.read_into("w", out) is out
    assert peak < w.nbytes // 16, peak  # straight into the caller's buffer
    assert same(stacked[0], w) and same(stacked[1], w)


@pytest.mark.parametrize(
    ("header", "data", "tensor_named"),
    [
        ({"a": f32([0, 12])}, bytes(12), False),  # dtype/shape vs offsets
        ({"a": f32([0, 8]), "b": f32([8, 16])}, bytes(8), False),  # truncated
        ({"a": f32([0, 8])}, bytes(12), False),  # trailing bytes
        ({"a": f32([0, 8]), "b": f32([12, 20])}, bytes(20), True),  # hole
        ({"a": f32([0, 8]), "b": f32([4, 12])}, bytes(12), True),  # overlap
    ],
)
def test_library_errors_name_no_file(tmp_path, header, data, tensor_named):
    path = write_raw(tmp_path / "hostile.safetensors", header, data)
    with pytest.raises(safetensors.SafetensorError) as e:
        safetensors.safe_open(str(path), framework="np")
    theirs = str(e.value)
    assert path.name not in theirs, theirs
    last = sorted(header)[-1]
    assert (f"`{last}`" in theirs) == tensor_named, theirs
    expect_error(path, f"'{last}'")  # ours names the file and the tensor


def test_library_accepts_duplicate_keys(tmp_path):
    raw = (
        b'{"a": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},'
        b' "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    )
    path = write_raw(tmp_path / "dup.safetensors", raw, np.array([1, 2], np.int32).tobytes())
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.keys() == ["a"]
        assert f.get_tensor("a").dtype == np.float32  # the last entry silently wins
    expect_error(path, "'a'", "twice")


def test_library_reads_one_file_not_an_index(tmp_path):
    save_tensors(layered(4), tmp_path, max_shard_size=800)
    index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(safetensors.SafetensorError):
        safetensors.safe_open(str(index), framework="np")
    with CheckpointReader(index) as reader:
        assert reader.keys() == list(layered(4))


def test_library_writes_owner_only_files(tmp_path):
    old = os.umask(0o022)
    try:
        safetensors.numpy.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "lib.safetensors")
        save_file({"a": np.zeros(2, np.float32)}, tmp_path / "edl.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "lib.safetensors").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "edl.safetensors").stat().st_mode & 0o777 == 0o644
