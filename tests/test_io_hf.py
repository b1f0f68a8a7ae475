"""edl.io.formats.hf: clear errors on bad checkpoints, HF cache / hub plumbing, config round
trips."""

import dataclasses
import json
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import edl
from edl.io.formats import hf
from edl.io.formats.safetensors import CheckpointError, load_file, save_file
from edl.models import LlamaConfig, LlamaForCausalLM, gemma, llama, mixtral, qwen3_moe
from edl.models.config import RunOptions
from edl.models.gemma import GemmaConfig
from edl.models.keymap import KeyRule, Placement

CONFIG = LlamaConfig(
    model_type="qwen2",
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    qkv_bias=True,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    model = LlamaForCausalLM.init(CONFIG, key=jax.random.key(0))
    edl.save_pretrained(model, directory)
    return model, directory


def _copy(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "m")
    return tmp_path / "m"


def _rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_round_trip_is_exact(saved):
    model, directory = saved
    again = edl.from_pretrained(directory)
    for (p, x), (q, y) in zip(
        edl.tree.flatten(model).items(), edl.tree.flatten(again).items(), strict=True
    ):
        assert p == q
        np.testing.assert_array_equal(x, y)
    assert again.config == model.config


def test_missing_unexpected_and_mismatched_keys_in_one_error(saved, tmp_path):
    directory = _copy(saved, tmp_path)

    def damage(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.7.mlp.up_proj.weight"] = np.zeros((24, 16), np.float32)  # layer 7 of 2
        t["model.extra.weight"] = np.zeros(3, np.float32)
        t["model.norm.weight"] = np.zeros(17, np.float32)

    _rewrite(directory, damage)
    with pytest.raises(ValueError, match="does not match the model") as err:
        edl.from_pretrained(directory)
    message = str(err.value)
    for expected in (
        "1 missing keys:\n  model.layers.1.mlp.up_proj.weight",
        "model.layers.7.mlp.up_proj.weight",
        "model.extra.weight",
        "model.norm.weight: checkpoint (17,), model expects (16,)",
    ):
        assert expected in message


def test_truncated_file_is_reported_before_loading(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        edl.from_pretrained(directory)


def test_unsupported_model_type_and_options(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        edl.from_pretrained(directory)
    bad_rope = {**config, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}
    bad_rope.pop("rope_parameters")
    with pytest.raises(ValueError, match="unsupported rope type 'proportional'"):
        LlamaConfig.from_hf(bad_rope)
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf({**config, "hidden_act": "mish"})
    with pytest.raises(ValueError, match="layer_types"):
        LlamaConfig.from_hf({**config, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="no task 'token_classification'"):
        edl.from_pretrained(saved[1], task="token_classification")


def test_config_round_trips_through_transformers():
    transformers = pytest.importorskip("transformers")
    configs = [
        CONFIG,
        CONFIG.replace(layer_windows=(None, 8)),
        CONFIG.replace(model_type="mistral", qkv_bias=False, sliding_window=8, layer_windows=None),
        CONFIG.replace(model_type="qwen3", qkv_bias=False, qk_norm=True, head_dim=12),
        CONFIG.replace(model_type="llama", qkv_bias=False, tie_word_embeddings=True),
    ]
    for config in configs:
        assert config.replace() == config  # nothing derived changes by itself
        hf_dict = config.to_hf(architectures=["X"])
        assert LlamaConfig.from_hf(hf_dict) == config
        # transformers reads the same architecture back.
        hf_config = transformers.AutoConfig.for_model(**hf_dict)
        assert LlamaConfig.from_hf(hf_config.to_dict()).replace(hf_extra=()) == config.replace(
            hf_extra=()
        )


def test_config_replace_rederives_defaults():
    wider = CONFIG.replace(hidden_size=32, num_hidden_layers=3)
    assert (wider.head_dim, wider.rope.dim, wider.layer_windows) == (16, 16, (None,) * 3)
    explicit = CONFIG.replace(head_dim=12)
    assert explicit.replace(hidden_size=64).head_dim == 12  # an explicit head_dim stays


def test_config_keeps_an_explicit_head_dim_equal_to_the_derived_one():
    # 16 / 2 heads = 8: the same value as derived, but given, so it survives a replace.
    explicit = CONFIG.replace(head_dim=8)
    assert explicit == CONFIG  # the same architecture ...
    assert explicit.replace(hidden_size=32).head_dim == 8  # ... but head_dim was given
    assert CONFIG.replace(hidden_size=32).head_dim == 16
    assert explicit.replace(hidden_size=32, head_dim=None).head_dim == 16  # None derives again
    # Families' own defaults for derived fields are given values (Gemma's head_dim = 256).
    gemma = GemmaConfig(num_hidden_layers=2)
    assert gemma.replace(hidden_size=512).head_dim == 256
    assert gemma.replace(num_key_value_heads=None).num_key_value_heads == 16  # = heads


def test_config_run_options_are_apart_from_the_architecture():
    config = CONFIG.replace(scan_layers=False, remat="full", attention_impl="reference")
    assert config.run == RunOptions(scan_layers=False, remat="full", attention_impl="reference")
    assert config.to_hf() == CONFIG.to_hf()  # never in config.json
    assert config.replace(run=RunOptions()) == CONFIG
    assert LlamaConfig.from_hf(CONFIG.to_hf(), remat="full").run.remat == "full"
    with pytest.raises(ValueError, match="remat"):
        CONFIG.replace(remat="everything")
    with pytest.raises(ValueError, match="run must be a RunOptions"):
        CONFIG.replace(run={"remat": "full"})


def test_config_keeps_unknown_hf_keys():
    config = LlamaConfig.from_hf({**CONFIG.to_hf(), "bos_token_id": 7, "my_field": [1, 2]})
    assert config.to_hf()["my_field"] == [1, 2]
    assert config.to_hf()["bos_token_id"] == 7


def test_from_pretrained_reads_the_local_hf_cache_offline(saved, tmp_path):
    """A repo id resolves through huggingface_hub's cache layout without any network."""
    _, directory = saved
    commit = "0" * 40
    repo = tmp_path / "models--edl-test--tiny"
    shutil.copytree(directory, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = edl.from_pretrained("edl-test/tiny", cache_dir=tmp_path, local_files_only=True)
    assert model.config == saved[0].config


def test_push_to_hub_uploads_a_loadable_folder(saved, tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["create"] = (repo_id, private, exist_ok)

        def upload_folder(self, *, repo_id, folder_path, revision, commit_message):
            shutil.copytree(folder_path, tmp_path / "uploaded")  # the folder dies afterwards
            calls["upload"] = (repo_id, commit_message)
            return "commit-info"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    model = saved[0]
    assert edl.push_to_hub(model, "me/tiny", private=True, token="t") == "commit-info"
    assert calls["create"] == ("me/tiny", True, True) and calls["token"] == "t"
    again = edl.from_pretrained(tmp_path / "uploaded")
    np.testing.assert_array_equal(again.lm_head.weight, model.lm_head.weight)


def test_from_state_dict_checks_like_from_pretrained():
    model = LlamaForCausalLM.init(CONFIG, key=jax.random.key(0))
    state = {k: t.load() for k, t in hf.export_state_dict(model).items()}
    rebuilt = edl.from_state_dict(CONFIG, state, dtype=jnp.bfloat16)
    assert rebuilt.model.embed_tokens.weight.dtype == jnp.bfloat16
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing keys:\n  lm_head\.weight"):
        edl.from_state_dict(CONFIG, state)


def test_key_table_both_ways():
    table = llama.HF_KEYS
    assert table.to_edl("model.layers.12.self_attn.q_proj.bias") == (
        Placement("model.layers.self_attn.q_proj.bias", (12,)),
    )
    assert table.to_edl("lm_head.weight") == (Placement("lm_head.weight"),)
    assert (
        table.to_hf("model.layers.mlp.down_proj.weight", 3) == "model.layers.3.mlp.down_proj.weight"
    )
    assert table.to_hf("layers.mlp.down_proj.weight", 0) == "layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="stacked over"):
        table.to_hf("model.layers.mlp.down_proj.weight")
    assert table.ignored("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_key_table_stacks_experts_splits_fused_tensors_and_groups_layers():
    table = mixtral.HF_KEYS
    w3 = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    assert table.to_edl(w3) == (Placement("model.layers.mlp.experts.up_proj", (1, 5)),)
    assert table.stack_depth("model.layers.mlp.experts.up_proj") == 2
    assert table.to_hf("model.layers.mlp.experts.up_proj", (1, 5)) == w3
    assert table.to_hf("layers.mlp.gate.weight", 2) == "layers.2.block_sparse_moe.gate.weight"
    # transformers 5's fused tensor: one HF key, two edl arrays, halves along axis 1.
    assert table.to_edl("model.layers.0.mlp.experts.gate_up_proj") == (
        Placement("model.layers.mlp.experts.gate_proj", (0,), (1, 0, 2)),
        Placement("model.layers.mlp.experts.up_proj", (0,), (1, 1, 2)),
    )
    # Dense layers 1 and 3 of 4 live in their own stack.
    grouped = qwen3_moe.HF_KEYS.with_layer_groups(
        ("layers", "dense_layers", "layers", "dense_layers")
    )
    assert grouped.to_edl("model.layers.3.mlp.up_proj.weight") == (
        Placement("model.dense_layers.mlp.up_proj.weight", (1,)),
    )
    assert grouped.to_edl("model.layers.2.mlp.experts.7.up_proj.weight") == (
        Placement("model.layers.mlp.experts.up_proj", (1, 7)),
    )
    assert grouped.to_hf("model.dense_layers.input_layernorm.weight", 1) == (
        "model.layers.3.input_layernorm.weight"
    )
    with pytest.raises(ValueError, match="only the HF template"):
        KeyRule("a.{layer}", "b.{layer}")
    with pytest.raises(ValueError, match="split axis"):
        KeyRule("a", ("b", "c"))


def test_duplicate_and_partial_expert_keys_are_named():
    """A checkpoint holding an expert both fused and per expert, or missing one expert,
    fails naming the keys."""
    config = {**_tiny_mixtral_hf(), "num_hidden_layers": 1}
    _, cfg, cls = edl.models.registry.resolve(config)
    # The errors come before any data is read: zeros of the right shapes will do.
    abstract = eqx.filter_eval_shape(cls.init, cfg, key=jax.random.key(0))
    state = {k: np.zeros(t.shape, t.dtype) for k, t in hf.export_state_dict(abstract).items()}
    experts = abstract.model.layers.mlp.experts
    gate, up = (np.zeros(x.shape[1:], x.dtype) for x in (experts.gate_proj, experts.up_proj))
    fused = {**state, "model.layers.0.mlp.experts.gate_up_proj": np.concatenate([gate, up], 1)}
    with pytest.raises(ValueError, match=r"duplicated keys:\n  model\.layers\.0\.mlp\.experts"):
        edl.from_state_dict(config, fused)
    del state["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    missing = r"1 missing keys:\n  model\.layers\.0\.block_sparse_moe\.experts\.1\.w2"
    with pytest.raises(ValueError, match=missing):
        edl.from_state_dict(config, state)


def _tiny_mixtral_hf():
    return edl.models.MixtralConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=3,
    ).to_hf()


def test_loading_streams_one_array_at_a_time(tmp_path, monkeypatch):
    """Host memory while loading peaks near the largest (stacked) array, not the checkpoint.

    tracemalloc sees numpy's host buffers, not XLA's device buffers, so a loader that read
    the whole checkpoint before placing it would peak at its full size. On CPU, device_put
    may alias a numpy buffer instead of copying it; copying here makes the CPU behave like
    an accelerator, whose memory tracemalloc does not see.
    """
    import tracemalloc

    device_put = jax.device_put
    monkeypatch.setattr(
        hf.jax, "device_put", lambda x, sharding=None: device_put(x, sharding).copy()
    )

    config = CONFIG.replace(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    edl.save_pretrained(model, tmp_path, max_shard_size="1MB")
    total = edl.nbytes(model)
    largest = max(x.nbytes for x in jax.tree.leaves(model))
    edl.from_pretrained(tmp_path)  # warm jax's caches: tracing allocates Python memory too
    tracemalloc.start()
    try:
        loaded = edl.from_pretrained(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total > 4 * largest  # the test means something only if arrays are many
    # One buffer being filled plus one the runtime releases a moment after its transfer.
    assert peak < 2.5 * largest, f"peak {peak} B while loading; largest array {largest} B"
    np.testing.assert_array_equal(
        loaded.model.layers.mlp.up_proj.weight, model.model.layers.mlp.up_proj.weight
    )


def test_from_pretrained_places_arrays_with_the_given_shardings(saved):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    model, directory = saved
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    by_vocab = NamedSharding(mesh, PartitionSpec("x", None))  # vocab 40 over 4 devices
    loaded = edl.from_pretrained(directory, sharding={"lm_head.weight": by_vocab})
    assert loaded.lm_head.weight.sharding == by_vocab
    assert len(loaded.lm_head.weight.addressable_shards) == 4
    np.testing.assert_array_equal(loaded.lm_head.weight, model.lm_head.weight)
    replicated = NamedSharding(mesh, PartitionSpec())
    everywhere = edl.from_pretrained(directory, sharding=replicated)
    assert all(x.sharding == replicated for x in jax.tree.leaves(everywhere))


def test_from_pretrained_takes_a_model_shaped_tree_of_shardings(saved):
    """What ``named_sharding(partition_specs(...))`` gives for the model; a tree or mapping
    whose paths are not the model's is refused, naming the first such path."""
    from jax.sharding import PartitionSpec

    from edl.sharding import make_mesh, partition_specs

    model, directory = saved
    mesh = make_mesh((1, 4, 2, 1))
    abstract = edl.abstract(LlamaForCausalLM.init, CONFIG, key=jax.random.key(0))
    shardings = edl.tree.named_sharding(partition_specs(abstract, None, mesh=mesh), mesh)
    loaded = edl.from_pretrained(directory, sharding=shardings)
    q = loaded.model.layers.self_attn.q_proj.weight  # (2, 16, 16): out over tp, in over fsdp
    assert q.sharding == shardings.model.layers.self_attn.q_proj.weight
    assert q.addressable_shards[0].data.shape == (2, 8, 4)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(got, want)

    tied = LlamaForCausalLM.init(CONFIG.replace(tie_word_embeddings=True), key=jax.random.key(0))
    other = edl.tree.named_sharding(partition_specs(tied, None, mesh=mesh), mesh)
    with pytest.raises(ValueError, match=r"the model's array 'lm_head.weight' has none"):
        edl.from_pretrained(directory, sharding=other)
    with pytest.raises(ValueError, match=r"'lm_head.wieght' is no array of the model"):
        edl.from_pretrained(directory, sharding={"lm_head.wieght": shardings.lm_head.weight})
    with pytest.raises(TypeError, match=r"'lm_head.weight' holds a PartitionSpec.*named_sharding"):
        edl.from_pretrained(directory, sharding={"lm_head.weight": PartitionSpec("tp")})


def _with_config(saved, tmp_path, text):
    directory = _copy(saved, tmp_path)
    (directory / "config.json").write_text(text)
    return directory


_POSITIVE = "must be a positive integer"
HOSTILE_CONFIGS = [
    ({"num_hidden_layers": 10**6}, rf"num_hidden_layers {_POSITIVE} of at most 4096 .*, got 10+$"),
    ({"num_attention_heads": 0}, f"num_attention_heads {_POSITIVE}, got 0"),
    ({"num_attention_heads": 3, "head_dim": None}, "hidden_size 16 is not divisible by num_"),
    ({"num_key_value_heads": 3}, "num_attention_heads 2 is not a multiple of num_key_value_heads"),
    ({"num_hidden_layers": "2"}, f"num_hidden_layers {_POSITIVE}, got '2'"),
    ({"vocab_size": True}, f"vocab_size {_POSITIVE}, got True"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"rope_scaling": [1, 2]}, r"rope_scaling must be an object or null, got \[1, 2\]"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "RoPE factor must be a number"),
]


@pytest.mark.parametrize(("change", "match"), HOSTILE_CONFIGS)
def test_hostile_config_json_fails_fast_naming_file_and_field(saved, tmp_path, change, match):
    config = {**json.loads((saved[1] / "config.json").read_text()), **change}
    directory = _with_config(saved, tmp_path, json.dumps(config))
    with pytest.raises(ValueError, match=f"^{re.escape(str(directory / 'config.json'))}: {match}"):
        edl.from_pretrained(directory)
    with pytest.raises(ValueError, match=f"^config.json: {match}"):
        LlamaConfig.from_hf(config)


def test_config_json_that_is_no_object_or_no_json_names_the_file(saved, tmp_path):
    directory = _with_config(saved, tmp_path, "[1, 2]")
    file = re.escape(str(directory / "config.json"))
    with pytest.raises(
        ValueError, match=f"^{file}: model config must hold a JSON object .* a list"
    ):
        edl.from_pretrained(directory)
    (directory / "config.json").write_text('{"model_type": "qwen2",\n "vocab_size": 40,,}')
    with pytest.raises(ValueError, match=f"^{file}: model config is not valid JSON: .* line 2"):
        edl.from_pretrained(directory)
    (directory / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=f"^{file}: model config is not UTF-8"):
        edl.from_pretrained(directory)


def test_layer_count_disagreeing_with_the_checkpoint_fails_before_building(
    saved, tmp_path, monkeypatch
):
    config = json.loads((saved[1] / "config.json").read_text())
    del config["layer_types"]  # one per layer
    directory = _with_config(saved, tmp_path, json.dumps({**config, "num_hidden_layers": 4000}))

    def no_build(*args, **kwargs):
        raise AssertionError("built the model before checking the layer count")

    monkeypatch.setattr(hf, "_load", no_build)
    file = re.escape(str(directory / "config.json"))
    with pytest.raises(
        ValueError,
        match=(
            rf"^{file}: num_hidden_layers is 4000, but the checkpoint holds 2 layers "
            r"\(tensors model.layers.0 to model.layers.1\)"
        ),
    ):
        edl.from_pretrained(directory)


def test_direct_config_construction_fails_fast_on_absurd_values():
    with pytest.raises(ValueError, match=rf"^num_hidden_layers {_POSITIVE} of at most 4096"):
        CONFIG.replace(num_hidden_layers=10**6)
    with pytest.raises(ValueError, match=f"^hidden_size {_POSITIVE}, got 0"):
        CONFIG.replace(hidden_size=0)
    with pytest.raises(ValueError, match=f"^num_attention_heads {_POSITIVE}, got 0"):
        LlamaConfig(num_attention_heads=0)
    with pytest.raises(ValueError, match=r"^rms_norm_eps must be a positive number, got nan"):
        CONFIG.replace(rms_norm_eps=float("nan"))
    with pytest.raises(ValueError, match=r"^query_pre_attn_scalar must be a positive number"):
        gemma.Gemma2Config(query_pre_attn_scalar=0.0)

    @dataclasses.dataclass(frozen=True)
    class Subclass(LlamaConfig):  # annotations as types, not strings (no __future__ here)
        extra_layers: int | None = None

    with pytest.raises(ValueError, match=r"^extra_layers must be an integer, got 2\.5"):
        Subclass(extra_layers=2.5)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.bool_, "uint8"])
def test_non_floating_dtypes_are_refused(saved, tmp_path, dtype):
    model, directory = saved
    name = jnp.dtype(dtype).name
    floating = f"dtype must be a floating dtype such as float32 or bfloat16, got {name}$"
    with pytest.raises(ValueError, match=f"^from_pretrained: {floating}"):
        edl.from_pretrained(directory, dtype=dtype)
    with pytest.raises(ValueError, match=f"^save_pretrained: {floating}"):
        edl.save_pretrained(model, tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=f"^LlamaForCausalLM.init: {floating}"):
        LlamaForCausalLM.init(CONFIG, key=jax.random.key(0), dtype=dtype)
    with pytest.raises(ValueError, match=f"^to_dtype: {floating}"):
        edl.module.to_dtype(model, dtype)


def test_missing_local_path_is_named_not_taken_for_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for path in [tmp_path / "nope", "./nope", "../nope", "runs/a/final", "runs/.hidden", "a b"]:
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            edl.from_pretrained(path)


def test_repo_id_shaped_name_goes_to_the_hub_and_notes_a_local_near_miss(tmp_path, monkeypatch):
    """ "runs/final" is a valid repo id: a local "runs/" folder must not hijack it (think of a
    "meta-llama/" download folder and "meta-llama/Llama-3.2-1B"), but a hub failure says
    that the local path is missing too."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    asked = []

    def not_found(repo_id, **kwargs):
        asked.append(repo_id)
        raise OSError(f"{repo_id} is not on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(OSError, match="runs/final is not on the hub") as info:
        hf.resolve_directory("runs/final")
    assert asked == ["runs/final"]
    assert info.value.__notes__ == [
        "edl: no local directory runs/final either (though runs exists)"
    ]
