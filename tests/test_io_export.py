"""edl.io.export.export_model: what it copies stays inside the source, and the target it
replaces (a directory, or the directory a symlink points to) is whole at every step."""

import json
import re
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import edl
from edl.io import export
from edl.io.checkpoint import save_state
from edl.io.export import EXPORT_MARKER, export_model
from edl.io.formats.files import UnsafePathError
from edl.models import LlamaConfig, LlamaForCausalLM

LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
SECRET = "hf_SECRET_TOKEN"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama checkpoint (state.json lists no tokenizer files); constant weights, as
    initialising them eagerly would take seconds."""
    shapes = eqx.filter_eval_shape(LlamaForCausalLM.init, LLAMA, key=jax.random.key(0))
    model = jax.tree.map(
        lambda x: jnp.full(x.shape, 0.01, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x,
        shapes,
    )
    state = edl.create_state(model, optax.sgd(0.1))
    return save_state(state, tmp_path_factory.mktemp("run"), save_optimizer=False)


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A copy of ``saved`` to tamper with, and a secret file beside it."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text(SECRET)
    return shutil.copytree(saved, tmp_path / "run" / saved.name)


def _set_tokenizer_files(checkpoint, names):
    info = json.loads((checkpoint / "state.json").read_text())
    info["tokenizer_files"] = names
    (checkpoint / "state.json").write_text(json.dumps(info))


def _leftovers(*directories):
    return [p for d in directories for p in d.iterdir() if p.name.startswith((".tmp-", ".old-"))]


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_tokenizer_files_outside_the_checkpoint_are_not_exported(tmp_path, checkpoint, how):
    """``state.json``'s ``tokenizer_files`` naming the secret (an absolute path, ``..``, or
    a name linked to it) is refused, naming state.json and the entry; nothing is written."""
    names = {"absolute": str(tmp_path / "secret" / "token"), "dotdot": "../../secret/token"}
    name = names.get(how, "tokenizer.json")
    if how == "symlink":
        (checkpoint / "tokenizer.json").symlink_to(tmp_path / "secret" / "token")
    _set_tokenizer_files(checkpoint, [name])
    where = re.escape(f"{checkpoint / 'state.json'}: tokenizer_files[0] = {name!r}")
    with pytest.raises(UnsafePathError, match=where):
        export_model(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export").exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_a_fixed_name_file_linked_out_of_the_source_is_not_exported(tmp_path, checkpoint, name):
    """A file export copies under its own name (a tokenizer file of TOKENIZER_FILES, the
    generation config) that is a symlink leading out of the model directory is refused,
    naming it: the export would otherwise carry the secret (``{"token": ...}`` is a valid
    generation config)."""
    (checkpoint / "state.json").unlink()  # a plain Hugging Face model directory
    (tmp_path / "secret" / "token").write_text(json.dumps({"token": SECRET}))
    (checkpoint / name).symlink_to(tmp_path / "secret" / "token")
    with pytest.raises(UnsafePathError, match=re.escape(f"{checkpoint / name} is a symlink")):
        export_model(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export").exists() and not _leftovers(tmp_path)


def test_a_hub_cache_snapshot_exports_its_linked_files(tmp_path, checkpoint):
    """A hub cache snapshot links every file to the repo's ``blobs/``: those links stay
    inside the downloaded repo, so its tokenizer files are exported; a link from the
    snapshot to anywhere else is still refused."""
    (checkpoint / "state.json").unlink()
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in checkpoint.iterdir():
        blob = blobs / f"blob-{file.name}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", "blob-config.json"))
    export_model(snapshot, tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_text() == (
        blobs / "blob-config.json"
    ).read_text()
    (snapshot / "tokenizer.json").unlink()
    (tmp_path / "secret" / "token").write_text(json.dumps({"token": SECRET}))
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "secret" / "token")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        export_model(snapshot, tmp_path / "export")


def test_tokenizer_files_must_exist_and_not_replace_the_model(tmp_path, checkpoint):
    _set_tokenizer_files(checkpoint, ["tokenizer.json"])
    with pytest.raises(FileNotFoundError, match=r"tokenizer_files\[0\] = 'tokenizer.json'"):
        export_model(checkpoint, tmp_path / "export")
    _set_tokenizer_files(checkpoint, ["config.json"])  # would overwrite the export's own
    with pytest.raises(ValueError, match=r"'config\.json', a file the export writes itself"):
        export_model(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export").exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "renamed-aside"])
def test_export_through_a_symlink_replaces_the_linked_export(
    tmp_path, checkpoint, swap, monkeypatch
):
    """``out_dir`` a symlink to an earlier export: the export it points to is replaced and
    the link stays a link to it; nothing is left beside either. Both where the OS swaps two
    directories in one step and where the earlier export is renamed aside first."""
    if not swap:
        monkeypatch.setattr(export, "_exchange", lambda new, out: False)
    exports = tmp_path / "exports"
    first = export_model(checkpoint, exports / "v1")
    link = tmp_path / "latest"
    link.symlink_to(first)
    assert export_model(checkpoint, link, dtype="bfloat16") == link
    assert link.is_symlink() and link.resolve() == first.resolve()
    assert json.loads((first / EXPORT_MARKER).read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in first.iterdir()) == sorted(
        ["config.json", EXPORT_MARKER, "model.safetensors"]
    )
    assert not _leftovers(tmp_path, exports)
    assert edl.from_pretrained(link).config.vocab_size == LLAMA.vocab_size
    assert export_model(checkpoint, first) == first  # the directory itself, again
    assert json.loads((first / EXPORT_MARKER).read_text())["dtype"] is None
    assert not _leftovers(tmp_path, exports)


@pytest.mark.parametrize("to", ["file", "other", "nothing"])
def test_export_refuses_a_symlink_to_anything_but_an_export(tmp_path, checkpoint, to):
    target = tmp_path / to
    if to == "file":
        target.write_text("mine")
    elif to == "other":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(target)
    error = FileNotFoundError if to == "nothing" else FileExistsError
    with pytest.raises(error, match=re.escape(f"{link} (a symlink to {target})")):
        export_model(checkpoint, link)
    assert link.is_symlink() and link.resolve() == target
    assert not _leftovers(tmp_path) and (to != "other" or (target / "notes.txt").is_file())
