"""Hugging Face interop: ``from_pretrained`` / ``save_pretrained`` / ``push_to_hub``,
``from_state_dict`` and ``to_torch``.

Names map through the family's declarative key table (``edl.models.keymap``) in both
directions. Loading checks the whole checkpoint against the model first (missing,
unexpected and mis-shaped keys in one error), then streams tensor by tensor into one
preallocated host buffer per edl array (``edl.io.formats.plan``: a stacked layer array receives
every layer's tensor), sending each buffer to the device before the next is filled: peak
host memory is one array, not the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec, Sharding
from jax.typing import DTypeLike

from edl._hub import hub_offline, is_repo_id, no_such_path, offline_error
from edl.io.formats import mxfp4
from edl.io.formats.files import read_json, write_json_atomic
from edl.io.formats.manifest import Manifest, describe
from edl.io.formats.plan import TensorSource, load_arrays, plan_load
from edl.io.formats.safetensors import CheckpointReader, LazyTensor, save_tensors
from edl.models import registry
from edl.models.keymap import KeyTable
from edl.module import require_float_dtype
from edl.text.tokenizer import Tokenizer
from edl.tree import flatten, is_array_like, named_map

__all__ = [
    "export_state_dict",
    "from_pretrained",
    "from_state_dict",
    "load_config",
    "load_generation_config",
    "push_to_hub",
    "resolve_directory",
    "save_pretrained",
    "save_tokenizer",
    "to_torch",
]

CONFIG_NAME = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
"""A PEFT adapter's config; beside ``config.json`` it makes an "embedded adapter" directory."""
GENERATION_CONFIG_NAME = "generation_config.json"


# -- resolving files ----------------------------------------------------------------------


def resolve_directory(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    token: str | None = None,
) -> Path:
    """A local directory as is; otherwise a hub repo id, fetched (config + safetensors only)
    through ``huggingface_hub``, which serves the local HF cache when offline.

    What is not a repo id (``edl._hub.is_repo_id``: absolute paths, ``./``, ``../``, ``~``,
    more than one ``/``, a file extension, characters a repo name cannot hold) is a local
    path, and a missing one raises ``FileNotFoundError`` naming it, with no network access.
    With ``HF_HUB_OFFLINE=1`` only the local cache is read, and a miss says so. A
    repo-id-shaped string goes to the hub even when part of it exists locally, as in
    transformers: a local ``meta-llama/`` folder must not stop ``"meta-llama/Llama-3.2-1B"``
    from downloading.
    When the hub then fails, the error notes the local near miss, in case a path was meant.
    """
    text = os.fspath(path_or_repo_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint directory")
    if not is_repo_id(text):
        raise no_such_path(text)
    if hub_offline() and not local_files_only:
        local_files_only = True  # no network at all; the cache may still hold it
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                text,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
                allow_patterns=["*.json", "*.safetensors"],
            )
        )
    except Exception as e:
        if hub_offline():
            raise offline_error(text) from e
        if path.parent != Path(".") and path.parent.is_dir():
            e.add_note(f"edl: no local directory {path} either (though {path.parent} exists)")
        raise


def load_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` dict of a checkpoint directory (``ValueError`` naming the file
    when it is not a JSON object)."""
    file = Path(directory) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_NAME}")
    return read_json(file, what="model config")


def _resolve_config(
    hf_config: Mapping[str, Any], task: str | None, file: Path | None = None
) -> tuple[registry.Family, Any, type]:
    """``registry.resolve``, with ``config.json`` in its errors replaced by ``file``."""
    try:
        return registry.resolve(hf_config, task)
    except ValueError as e:
        prefix = f"{CONFIG_NAME}: "
        if file is None or not str(e).startswith(prefix):
            raise
        raise ValueError(f"{file}: {str(e).removeprefix(prefix)}") from e


_LAYER_KEY = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _check_layer_count(config: Any, keys: Iterable[str], where: str, table: Any = None) -> None:
    """Fail fast, before anything is built, when the checkpoint holds layers ``0..m-1``
    (tensors ``model.layers.{i}.*``) for a config of ``num_hidden_layers != m``. Gaps and
    stray indices are left to the load plan, which lists every missing and unexpected key.
    Keys the key ``table`` ignores (DeepSeek-V3's multi-token-prediction layers) do not count."""
    keys = keys if table is None else (k for k in keys if not table.ignored(k))
    layers = {int(m.group(1)) for k in keys if (m := _LAYER_KEY.match(k))}
    if not layers:
        return
    n = config.num_hidden_layers
    if len(layers) != n and layers == set(range(len(layers))):
        raise ValueError(
            f"{where}: num_hidden_layers is {n}, but the checkpoint holds {len(layers)} layers "
            f"(tensors model.layers.0 to model.layers.{len(layers) - 1})"
        )


# -- loading ------------------------------------------------------------------------------


def _leaf_shardings(sharding: Any, targets: Mapping[str, Any]) -> dict[str, Sharding]:
    """edl path -> sharding of each array to load, from ``from_pretrained``'s ``sharding``: a
    ``Sharding`` for every array, a flat or nested mapping of some paths, or a pytree of the
    model's structure (``edl.tree.named_sharding(edl.sharding.partition_specs(...), mesh)``)
    holding one for every array."""
    if sharding is None:
        return {}
    if isinstance(sharding, Sharding):
        return dict.fromkeys(targets, sharding)
    flat = flatten(sharding)
    for path, leaf in flat.items():
        if isinstance(leaf, PartitionSpec):
            raise TypeError(
                f"sharding: {path!r} holds a PartitionSpec, not a Sharding (map "
                f"specs to shardings with edl.tree.named_sharding)"
            )
        if not isinstance(leaf, Sharding):
            raise TypeError(
                f"sharding: {path!r} holds a {type(leaf).__name__}, not a jax.sharding.Sharding"
            )
    unknown = [p for p in flat if p not in targets]
    missing = [] if isinstance(sharding, Mapping) else [p for p in targets if p not in flat]
    if unknown or missing:
        what = "mapping" if isinstance(sharding, Mapping) else f"{type(sharding).__name__} tree"
        first = (
            f"{unknown[0]!r} is no array of the model"
            if unknown
            else f"the model's array {missing[0]!r} has none"
        )
        raise ValueError(
            f"sharding: the {what} does not match the model's arrays: {first} "
            f"({len(unknown)} unknown, {len(missing)} without a sharding; the model has e.g. "
            f"{sorted(targets)[:3]})"
        )
    return flat


def _load(
    model_cls: type,
    config: Any,
    source: TensorSource,
    table: KeyTable,
    *,
    dtype: DTypeLike | None = None,
    sharding: Any = None,
) -> eqx.Module:
    abstract = eqx.filter_eval_shape(model_cls.init, config, key=jax.random.key(0))
    targets = {p: x for p, x in flatten(abstract).items() if is_array_like(x)}
    tied = getattr(config, "tie_word_embeddings", False)
    plan = plan_load(table, targets, source, tie_word_embeddings=tied)
    shardings = _leaf_shardings(sharding, targets)

    def loaded_as(path: str, target: Any) -> jax.ShapeDtypeStruct:
        """The stored dtype, or ``dtype`` for floating arrays; placed by ``sharding``."""
        cast = dtype is not None and jnp.issubdtype(target.dtype, jnp.inexact)
        want = dtype if cast else source.dtype(plan.first_key(path))
        try:
            return jax.ShapeDtypeStruct(target.shape, want, sharding=shardings.get(path))
        except ValueError as e:  # a sharding of another rank, found before any read
            raise ValueError(f"sharding: {path!r}: {e}") from None

    leaves = load_arrays(plan, {p: loaded_as(p, t) for p, t in targets.items()}, progress=True)
    # Every array leaf is in the plan, so no abstract leaf survives.
    return named_map(lambda path, leaf: leaves.get(path, leaf), abstract)


def _dequantized(hf_config: Mapping[str, Any], source: TensorSource) -> TensorSource:
    """``source`` with an MXFP4 checkpoint's block / scale pairs read as float tensors in
    the checkpoint's dtype (``edl.io.formats.mxfp4``); other sources as they are."""
    if not mxfp4.is_mxfp4(hf_config):
        return source
    return mxfp4.dequantized_source(source, mxfp4.checkpoint_dtype(hf_config))


def from_pretrained(
    path_or_repo_id: str | os.PathLike[str],
    *,
    dtype: DTypeLike | None = None,
    revision: str | None = None,
    task: str | None = None,
    sharding: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    token: str | None = None,
    **config_overrides: Any,
) -> eqx.Module:
    """Load a HF checkpoint (local directory, HF cache or hub repo id) as an edl model.

    Args:
        dtype: cast floating weights to this floating dtype; ``None`` keeps the stored
            dtypes.
        revision: hub branch, tag or commit.
        task: ``"causal_lm"``, ``"sequence_classification"`` or ``"base"``; default from
            ``architectures`` in ``config.json``.
        sharding: a ``jax.sharding.Sharding`` for every array; a nested/flat mapping of edl
            paths to shardings (paths left out: the default device); or a pytree of the
            model's structure with a sharding per array, such as
            ``edl.tree.named_sharding(edl.sharding.partition_specs(abstract_model, None,
            mesh=mesh), mesh)``. Paths that are not the model's raise. Each array goes
            straight to its devices.
        cache_dir, local_files_only, token: passed to ``huggingface_hub.snapshot_download``
            for repo ids (``local_files_only=True``, or ``HF_HUB_OFFLINE=1``, reads only the
            local HF cache).
        config_overrides: edl config fields such as ``remat="full"`` or ``scan_layers=False``.
    """
    if dtype is not None:
        require_float_dtype(dtype, "from_pretrained: dtype")
    directory = resolve_directory(
        path_or_repo_id,
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        token=token,
    )
    file = directory / CONFIG_NAME
    hf_config = load_config(directory)
    family, config, model_cls = _resolve_config(hf_config, task, file)
    if config_overrides:
        config = config.replace(**config_overrides)
    with CheckpointReader.open(directory) as reader:
        table = family.key_table_for(config, model_cls)
        _check_layer_count(config, reader.keys(), str(file), table)
        source = _dequantized(hf_config, TensorSource.from_reader(reader))
        model = _load(model_cls, config, source, table, dtype=dtype, sharding=sharding)
    generation = load_generation_config(directory)
    if generation and hasattr(model, "generation_config"):
        model = dataclasses.replace(model, generation_config=generation)
    if (directory / ADAPTER_CONFIG).is_file():
        warnings.warn(
            f"from_pretrained: {directory} also holds a PEFT adapter ({ADAPTER_CONFIG}), which "
            "this loads without: edl.io.export.load_model(directory) applies it (as "
            "transformers does with peft installed), or edl.io.formats.peft.load_adapter(model, "
            "directory)",
            stacklevel=2,
        )
    return model


def load_generation_config(directory: str | os.PathLike[str]) -> tuple[tuple[str, str], ...]:
    """``directory``'s ``generation_config.json`` as sorted (key, JSON) pairs (a causal LM's
    ``generation_config`` field), or ``()`` when there is none."""
    file = Path(directory) / GENERATION_CONFIG_NAME
    if not file.is_file():
        return ()
    values = read_json(file, what="generation config")  # a JSON object, or it names the file
    return tuple(sorted((k, json.dumps(v)) for k, v in values.items()))


def from_state_dict(
    config: Any,
    mapping: Mapping[str, Any],
    *,
    task: str = "causal_lm",
    dtype: DTypeLike | None = None,
    sharding: Any = None,
) -> eqx.Module:
    """Build a model from HF-named arrays (numpy, jax, or a torch ``state_dict``).

    ``config`` is an edl config or a HF ``config.json`` dict (EasyDeL's ``transform_fn``).
    """
    if dtype is not None:
        require_float_dtype(dtype, "from_state_dict: dtype")
    source = TensorSource.from_mapping(mapping)
    if isinstance(config, Mapping):
        source = _dequantized(config, source)
        family, config, model_cls = registry.resolve(config, task)
    else:
        family, _, model_cls = registry.resolve(config.to_hf(), task)
    table = family.key_table_for(config, model_cls)
    _check_layer_count(config, mapping.keys(), "from_state_dict: config", table)
    return _load(model_cls, config, source, table, dtype=dtype, sharding=sharding)


# -- saving -------------------------------------------------------------------------------


def export_state_dict(
    model: eqx.Module,
    *,
    dtype: DTypeLike | None = None,
    key_table: KeyTable | None = None,
    manifest: Manifest | None = None,
) -> dict[str, LazyTensor]:
    """HF key -> lazily materialised numpy tensor, in HF naming (stacked arrays split per
    layer). Nothing is copied to the host until a tensor is loaded. ``dtype`` (casting
    floating weights) must be a floating dtype. ``key_table``: other names than the
    family's files use (PEFT adapters name HF's in-memory modules); else the table of
    ``manifest`` (``describe(model)`` when not given; pass the whole model's for a part of
    one, such as ``edl.lora.lora_params(model)`` of a quantized model, whose layer settings
    cannot be read from the part)."""
    if dtype is not None:
        require_float_dtype(dtype, "export_state_dict: dtype")
    table = key_table or (manifest or describe(model)).key_table()
    out: dict[str, LazyTensor] = {}
    for path, leaf in flatten(model).items():
        if not is_array_like(leaf):
            continue
        cast = dtype if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.inexact) else None
        out_dtype = np.dtype(cast or leaf.dtype)

        def load(index: tuple[int, ...], leaf: Any = leaf, cast: Any = cast) -> np.ndarray:
            x = leaf[index] if index else leaf
            return _on_host(x if cast is None else x.astype(cast))

        depth = table.stack_depth(path)
        for index in np.ndindex(*leaf.shape[:depth]):
            index = tuple(int(i) for i in index)
            out[table.to_hf(path, index or None)] = LazyTensor(
                tuple(leaf.shape[depth:]), out_dtype, lambda index=index, load=load: load(index)
            )
    return out


def _on_host(x: Any) -> np.ndarray:
    """``x`` as one host array; an array spread over several processes is all-gathered (a
    collective: every process asks for the same tensors in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _stored_dtype_name(tensors: Mapping[str, LazyTensor]) -> str | None:
    """The one floating dtype of the written weights (``config.json``'s ``torch_dtype``)."""
    floats = {t.dtype.name for t in tensors.values() if jnp.issubdtype(t.dtype, jnp.floating)}
    return floats.pop() if len(floats) == 1 else None


def save_pretrained(
    model: eqx.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GB",
    dtype: DTypeLike | None = None,
    tokenizer: Tokenizer | None = None,
    manifest: Manifest | None = None,
) -> Path:
    """Write ``model`` in HF layout (``config.json`` + safetensors, sharded with
    ``model.safetensors.index.json`` beyond ``max_shard_size``, and the causal LM's
    ``generation_config.json`` when it has one), loadable by transformers.

    ``dtype`` casts floating weights on the way out (one layer at a time). Tied heads are
    not written, as transformers does. ``tokenizer``'s files go beside the weights when it
    has any (anything with ``save(directory)``, such as ``edl.text.HFTokenizer``; the byte
    tokenizer has none), so ``AutoTokenizer.from_pretrained(directory)`` reads it. Each file
    is written atomically.

    A model spread over several processes streams out one tensor at a time: every process
    calls ``save_pretrained`` (same model, same directory), each tensor is all-gathered in
    turn, and process 0 writes it; no host ever holds more than one tensor of the model.

    ``manifest``: ``model``'s (``edl.io.formats.manifest.describe``), computed when not given.
    """
    if dtype is not None:
        require_float_dtype(dtype, "save_pretrained: dtype")
    manifest = manifest or describe(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = export_state_dict(model, dtype=dtype, manifest=manifest)
    if jax.process_index() != 0:  # gather each tensor with process 0, which writes it
        for tensor in tensors.values():
            tensor.load()
        return directory
    save_tensors(tensors, directory, max_shard_size=max_shard_size, metadata={"format": "pt"})
    generation = getattr(model, "generation_config", ())
    write_config(manifest, directory, _stored_dtype_name(tensors), generation=generation)
    save_tokenizer(tokenizer, directory)
    return directory


def write_config(
    manifest: Manifest,
    directory: str | os.PathLike[str],
    stored_dtype: str | None,
    *,
    generation: tuple[tuple[str, str], ...] = (),
) -> None:
    """The ``config.json`` of the model ``manifest`` describes (``stored_dtype``: the
    weights' one floating dtype, as ``torch_dtype``) and, when ``generation`` (a causal
    LM's ``generation_config``) holds any, ``generation_config.json`` into ``directory``."""
    if manifest.config is None:
        raise TypeError(f"{manifest.model_class} is not a registered edl model class")
    config = dict(manifest.config)
    if stored_dtype is not None:
        config["torch_dtype"] = config["dtype"] = stored_dtype  # transformers 4 / 5 spellings
    write_json_atomic(Path(directory) / CONFIG_NAME, config)
    if generation:
        values = {k: json.loads(v) for k, v in generation}
        write_json_atomic(Path(directory) / GENERATION_CONFIG_NAME, values)


def save_tokenizer(tokenizer: Tokenizer | None, directory: str | os.PathLike[str]) -> list[str]:
    """Write ``tokenizer``'s files into ``directory`` when it has a ``save(directory)``
    method (``edl.text.HFTokenizer``); returns the names written (``[]`` for ``None`` or a
    tokenizer without files, such as ``ByteTokenizer``)."""
    save = getattr(tokenizer, "save", None)
    if save is None:
        return []
    return sorted(Path(p).name for p in save(directory))


def push_to_hub(
    model: eqx.Module,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload model with edl",
    max_shard_size: int | str = "2GB",
    dtype: DTypeLike | None = None,
) -> Any:
    """``save_pretrained`` into a temporary directory, then upload it as one commit through
    ``huggingface_hub`` (creating the repo if needed). Returns the commit info."""
    if dtype is not None:
        require_float_dtype(dtype, "push_to_hub: dtype")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edl-push-") as tmp:
        save_pretrained(model, tmp, max_shard_size=max_shard_size, dtype=dtype)
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp, revision=revision, commit_message=commit_message
        )


def to_torch(model: eqx.Module) -> Any:  # a torch.nn.Module (torch not imported)
    """The equivalent ``transformers`` model (torch, eval mode) with ``model``'s weights.

    Goes through HF files in a temporary directory, so transformers applies its own weight
    conversions (e.g. fusing MoE experts). Needs ``torch`` and ``transformers`` (not
    dependencies of edl)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("to_torch needs torch and transformers installed") from e
    manifest = describe(model)
    with tempfile.TemporaryDirectory(prefix="edl-to-torch-") as tmp:
        save_pretrained(model, tmp, manifest=manifest)
        return getattr(transformers, manifest.architecture).from_pretrained(tmp).eval()
