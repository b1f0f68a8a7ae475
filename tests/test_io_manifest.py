"""edl.io.formats.manifest: a model's manifest round-trips through JSON and rebuilds the
model's structure; checkpoints store it in ``state.json``; checkpoints written before it
existed (no ``"manifest"``) still load and export to the same bytes."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.io.checkpoint import read_manifest, save_state, verify_checkpoint
from edl.io.export import export_model, load_model
from edl.io.formats.manifest import Manifest, describe, rebuild
from edl.lora import apply_lora
from edl.quantize import QuantConfig, is_linear, quantize
from edl.tree import find


def _bump(model):
    """Nonzero LoRA B (and every float moved), so adapters change the outputs."""
    return jax.tree.map(lambda x: x + 0.01 if jnp.issubdtype(x.dtype, jnp.floating) else x, model)


@pytest.fixture(scope="module")
def models(tiny_llama):
    lora = _bump(apply_lora(tiny_llama, rank=2, alpha=4, key=jax.random.key(7)))
    nf4 = quantize(tiny_llama, QuantConfig("nf4", block_size=32))
    qlora = _bump(apply_lora(nf4, rank=2, alpha=4, key=jax.random.key(8)))
    int8 = quantize(tiny_llama, QuantConfig("int8", block_size=32))
    return {"llama": tiny_llama, "lora": lora, "nf4-lora": qlora, "int8": int8}


def _structure(model):
    """Each array's path, shape and dtype, and each linear layer's class (the run options,
    which no file holds, aside)."""
    arrays = {p: (x.shape, jnp.dtype(x.dtype)) for p, x in edl.tree.flatten(model).items()}
    return arrays, {p: type(layer) for p, layer in find(model, is_linear).items()}


@pytest.mark.parametrize("name", ["llama", "lora", "nf4-lora", "int8"])
def test_manifest_round_trips_and_rebuilds_the_structure(models, name):
    model = models[name]
    manifest = describe(model)
    back = Manifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert back == manifest
    assert (back.family, back.task, back.architecture) == ("llama", "causal_lm", "LlamaForCausalLM")
    assert back.config == json.loads(json.dumps(model.config.to_hf(["LlamaForCausalLM"])))
    abstract = rebuild(back)
    assert _structure(abstract) == _structure(model)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in edl.tree.flatten(abstract).values())
    assert back.key_table().to_hf("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_manifest_records_lora_targets_and_quantization(models):
    manifest = describe(models["nf4-lora"])
    q_proj = "model.layers.self_attn.q_proj"
    assert manifest.lora_targets[q_proj] == {
        "rank": 2,
        "scaling": 2.0,
        "dropout": 0.0,
        "dtype": "float32",
    }
    assert manifest.quantized_layers[q_proj]["format"] == "nf4"
    assert manifest.quantized_layers[q_proj]["block_size"] == 32
    dense = manifest.without("quantized")
    assert not dense.quantized_layers and dense.lora_targets == manifest.lora_targets
    assert dense.without("lora").layer_structure == {} == describe(models["llama"]).layer_structure


def test_manifest_of_a_plain_tree():
    tree = {"w": jnp.ones((3, 4)), "b": jnp.zeros(3, jnp.int32)}
    manifest = describe(tree)
    assert manifest.to_json() == {
        "family": None,
        "task": None,
        "architecture": None,
        "model_class": "dict",
        "config": None,
        "layer_structure": {},
    }
    assert Manifest.from_json(manifest.to_json()) == manifest and not manifest.registered
    with pytest.raises(TypeError, match="dict is not a registered edl model class"):
        manifest.key_table()
    with pytest.raises(ValueError, match="dict, which no registered family builds"):
        rebuild(manifest)


def test_from_json_names_what_is_wrong(models):
    good = describe(models["lora"]).to_json()
    with pytest.raises(ValueError, match=r"state.json: manifest: expected an object"):
        Manifest.from_json([], where="state.json: manifest")
    with pytest.raises(ValueError, match=r"m.task: expected a string or null, got 3"):
        Manifest.from_json({**good, "task": 3}, where="m")
    with pytest.raises(ValueError, match=r"m.layer_structure: expected an object of layer"):
        Manifest.from_json({**good, "layer_structure": {"q": {"dora": {}}}}, where="m")
    with pytest.raises(ValueError, match=r"fields .*'config'.*got \['family'\]"):
        Manifest.from_json({"family": "llama"}, where="m")
    wrong_family = Manifest.from_json({**good, "family": "gemma"})
    with pytest.raises(ValueError, match=r"family 'gemma', but .* model_type 'llama'"):
        wrong_family.key_table()


def _save(model, directory, **kwargs):
    state = edl.create_state(model, optax.adamw(1e-3))
    return save_state(state, directory, **kwargs)


def _strip_manifest(checkpoint):
    """The checkpoint as edl wrote it before manifests: ``state.json`` without its key."""
    info = json.loads((checkpoint / "state.json").read_text())
    del info["manifest"]
    (checkpoint / "state.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _arrays(model):
    return {p: np.asarray(x) for p, x in edl.tree.flatten(model).items() if hasattr(x, "shape")}


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("name", ["lora", "nf4-lora", "int8"])
def test_state_json_holds_the_manifest_and_old_checkpoints_load_the_same(models, tmp_path, name):
    model = models[name]
    new = _save(model, tmp_path / "new")
    info = verify_checkpoint(new)
    assert info["manifest"] == describe(model).to_json()
    assert info["layers"] == info["manifest"]["layer_structure"]  # kept for older readers
    old = tmp_path / "old" / new.name
    shutil.copytree(new, old)
    _strip_manifest(old)
    assert read_manifest(old, verify_checkpoint(old)) == read_manifest(new, info)
    loaded_new, loaded_old = _arrays(load_model(new)), _arrays(load_model(old))
    assert loaded_new.keys() == loaded_old.keys() == _arrays(model).keys()
    for path, array in _arrays(model).items():
        assert loaded_old[path].dtype == array.dtype
        assert loaded_old[path].tobytes() == loaded_new[path].tobytes() == array.tobytes(), path
    export_new = export_model(new, tmp_path / "export-new")
    export_old = export_model(old, tmp_path / "export-old")
    new_files, old_files = _files(export_new), _files(export_old)
    marker = "edl_export.json"  # names its source, which differs
    assert json.loads(old_files.pop(marker))["source"] == str(old.resolve())
    new_files.pop(marker)
    adapter = "adapter_config.json"  # names where the export was written
    if adapter in new_files:
        assert json.loads(new_files.pop(adapter)) == {
            **json.loads(old_files.pop(adapter)),
            "base_model_name_or_path": str(export_new.resolve()),
        }
    assert new_files == old_files


def test_an_old_sharded_checkpoint_exports_the_same(tiny_llama, tmp_path):
    new = _save(tiny_llama, tmp_path / "new", sharded=True)
    old = tmp_path / "old" / new.name
    shutil.copytree(new, old)
    _strip_manifest(old)
    assert read_manifest(old, verify_checkpoint(old)) == describe(tiny_llama)
    new_files = _files(export_model(new, tmp_path / "export-new", dtype="bfloat16"))
    old_files = _files(export_model(old, tmp_path / "export-old", dtype="bfloat16"))
    new_files.pop("edl_export.json"), old_files.pop("edl_export.json")
    assert new_files == old_files and "model.safetensors" in new_files


def test_a_plain_tree_checkpoint_records_its_manifest(tmp_path):
    tree = {"w": jnp.arange(6.0).reshape(2, 3)}
    checkpoint = _save(tree, tmp_path)
    info = verify_checkpoint(checkpoint)
    assert info["model_format"] == "tree" and info["manifest"]["model_class"] == "dict"
    _strip_manifest(checkpoint)
    assert read_manifest(checkpoint, verify_checkpoint(checkpoint)) == Manifest(
        None, None, None, None, None, {}
    )
