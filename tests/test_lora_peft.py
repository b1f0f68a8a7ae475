"""PEFT interop: adapters written by edl load in peft + transformers with the same logits and
the same file layout peft itself writes; adapters written by peft (rank/alpha patterns,
rsLoRA, an adapted LM head) load in edl with the same logits; edl adapts the layers peft
adapts from the same files (target_modules, exclude_modules), with peft's errors and warnings.

Tolerance: float32 forward passes of a 2-layer model with dims <= 64 in torch and XLA
differ by ~1e-6 relative (summation order); 1e-4 absolute on logits of size ~1 leaves room
for that and nothing else (the adapters move the logits by > 1e-2).
"""

from __future__ import annotations

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import edl
from edl.io.formats.peft import load_adapter, save_adapter
from edl.io.formats.safetensors import load_file, save_file
from edl.lora import apply_lora, lora_params, wrap_lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-4


_forward = jax.jit(lambda m, i: m(i).logits)


def _torch_logits(torch_model, ids):
    with torch.no_grad():
        return torch_model(torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()


def _random_b(model):
    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(0.1 * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


def test_edl_adapter_loads_in_peft_with_the_same_logits(tiny_llama, tiny_ids, tmp_path):
    lora = apply_lora(
        tiny_llama, rank=4, alpha=8, pattern=r"(q|k|v|o|gate|up)_proj$", key=jax.random.key(2)
    )
    lora = _random_b(apply_lora(lora, rank=2, alpha=3, pattern="down_proj", key=jax.random.key(3)))
    out = np.asarray(_forward(lora, tiny_ids))
    assert np.abs(out - np.asarray(_forward(tiny_llama, tiny_ids))).max() > 1e-2
    save_adapter(lora, tmp_path / "edl", base_model_name_or_path="edl-tiny")

    config = json.loads((tmp_path / "edl" / "adapter_config.json").read_text())
    targets = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, targets)
    patterns = {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"down_proj": 3}}
    assert {k: config[k] for k in patterns} == patterns
    assert config["base_model_name_or_path"] == "edl-tiny"
    # The same keys, shapes and dtypes peft writes for this configuration.
    theirs = peft.get_peft_model(
        edl.to_torch(tiny_llama),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", **patterns
        ),
    )
    theirs.save_pretrained(tmp_path / "peft")
    mine = load_file(tmp_path / "edl", prefix="adapter_model")
    reference = load_file(tmp_path / "peft", prefix="adapter_model")
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {
        k: (v.shape, v.dtype) for k, v in reference.items()
    }
    assert mine["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 2)

    loaded = peft.PeftModel.from_pretrained(edl.to_torch(tiny_llama), tmp_path / "edl")
    np.testing.assert_allclose(_torch_logits(loaded, tiny_ids), out, rtol=0, atol=TOL)
    # And back: edl reads its own file exactly.
    again = load_adapter(tiny_llama, tmp_path / "edl")
    for a, b in zip(
        jax.tree.leaves(lora_params(again)), jax.tree.leaves(lora_params(lora)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "options",
    [
        {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3}},
        {"use_rslora": True, "lora_dropout": 0.1},
    ],
)
def test_peft_adapter_loads_in_edl_with_the_same_logits(tiny_llama, tiny_ids, tmp_path, options):
    config = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **options,
    )
    base = edl.to_torch(tiny_llama)
    with torch.no_grad():  # peft saves an adapted head's base weight too: it must win
        base.lm_head.weight.mul_(1.5)
    theirs = peft.get_peft_model(base, config).eval()
    want = _torch_logits(theirs, tiny_ids)
    theirs.save_pretrained(tmp_path)

    lora = load_adapter(tiny_llama, tmp_path)
    layers = lora.model.layers
    assert layers.self_attn.v_proj.rank == (2 if "rank_pattern" in options else 4)
    assert lora.lm_head.lora_A.weight.shape == (4, tiny_llama.config.hidden_size)
    assert layers.mlp.down_proj.scaling == pytest.approx(
        3 / 4 if "alpha_pattern" in options else 12 / 2 if options.get("use_rslora") else 3.0
    )
    assert layers.self_attn.q_proj.dropout == options.get("lora_dropout", 0.0)
    np.testing.assert_allclose(np.asarray(_forward(lora, tiny_ids)), want, rtol=0, atol=TOL)


def test_load_adapter_errors_name_the_problem(tiny_llama, tmp_path):
    lora = apply_lora(tiny_llama, rank=2, alpha=2, pattern="q_proj", key=jax.random.key(0))
    save_adapter(lora, tmp_path)
    with pytest.raises(ValueError, match=r"already carry LoRA"):
        load_adapter(lora, tmp_path)

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for field in ("r", "lora_alpha"):
        _write_config(tmp_path, {k: v for k, v in config.items() if k != field})
        with pytest.raises(ValueError, match=rf"adapter_config.json: no '{field}'"):
            load_adapter(tiny_llama, tmp_path)
    _write_config(tmp_path, {**config, "use_dora": True})
    with pytest.raises(ValueError, match=r"unsupported PEFT options \['use_dora'\]"):
        load_adapter(tiny_llama, tmp_path)
    _write_config(tmp_path, {**config, "init_lora_weights": "pissa"})
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' \(PEFT re-derives the base"):
        load_adapter(tiny_llama, tmp_path)
    _write_config(tmp_path, config)

    tensors = load_file(tmp_path, prefix="adapter_model")
    del tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    # PEFT would keep its random lora_A there (next to the file's lora_B): not reproducible.
    with pytest.raises(ValueError, match=r"without lora_A \['model\.layers\.1\.self_attn\.q_proj'"):
        load_adapter(tiny_llama, tmp_path)


def _write_config(directory, config):
    (directory / "adapter_config.json").write_text(json.dumps(config))


# -- target_modules / exclude_modules, with peft as the oracle -------------------------------
#
# One adapter file with (random) adapters on q/k/v_proj of both layers, loaded under several
# adapter_config.json variants by peft and by edl: the same layers must be adapted, the same
# tensors used and the logits agree.

_QKV = ["q_proj", "k_proj", "v_proj"]


@pytest.fixture(scope="module")
def qkv_adapter(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("qkv")
    torch.manual_seed(0)
    theirs = peft.get_peft_model(
        edl.to_torch(tiny_llama),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=_QKV, init_lora_weights=False, task_type="CAUSAL_LM"
        ),
    )
    theirs.save_pretrained(directory)
    return directory


def _variant(source, directory, **changes):
    directory.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    _write_config(directory, {**config, **changes})
    shutil.copy(source / "adapter_model.safetensors", directory)
    return directory


def _peft_load(tiny_llama, directory):
    """peft's model from the files, and the names of the modules it adapted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own (about the temporary HF directory)
        theirs = peft.PeftModel.from_pretrained(edl.to_torch(tiny_llama), directory).eval()
    names = {
        n.removeprefix("base_model.model.")
        for n, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    return names, theirs


def _adapted(lora):
    """HF module name -> whether its lora_B is nonzero, for every adapter of an edl model."""
    tensors = edl.io.formats.hf.export_state_dict(lora_params(lora))
    suffix = ".lora_B.weight"
    return {
        k.removesuffix(suffix): bool(np.any(t.load()))
        for k, t in tensors.items()
        if k.endswith(suffix)
    }


def _layers(*names, layers=(0, 1)):
    return {f"model.layers.{i}.{n}" for i in layers for n in names}


_Q, _K, _V = (_layers(f"self_attn.{m}") for m in ("q_proj", "k_proj", "v_proj"))
_LAYER = [_layers(*(f"self_attn.{m}" for m in _QKV), layers=(i,)) for i in (0, 1)]
_O_MLP = [
    _layers("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", layers=(i,))
    for i in (0, 1)
]


@pytest.mark.parametrize(
    ("changes", "adapted", "zero", "stacked", "warns"),
    [
        # A list: names or dotted suffixes. The file's k_proj tensors are ignored (by peft
        # silently).
        (
            {"target_modules": ["q_proj", "self_attn.v_proj"]},
            _Q | _V,
            set(),
            set(),
            r"are ignored.*k_proj\.lora_A",
        ),
        # A string: a regex matching the whole name, here layer 0 only. edl stacks layers, so
        # layer 1 gets adapters too, with B = 0 (the same outputs).
        (
            {"target_modules": r".*\.0\.self_attn\.(q|k)_proj"},
            (_Q | _K) & _LAYER[0],
            set(),
            (_Q | _K) & _LAYER[1],
            r"stacked layers",
        ),
        # o_proj is targeted but not in the file: peft starts it from B = 0 and warns.
        # exclude_modules as a list.
        (
            {
                "target_modules": [*_QKV, "o_proj"],
                "exclude_modules": ["k_proj"],
                "init_lora_weights": True,
            },
            _Q | _V,
            _layers("self_attn.o_proj"),
            set(),
            r"no adapter tensors for the targeted modules \['model\.layers\.0\.self_attn\.o_proj",
        ),
        # "all-linear" (every linear layer but the head), exclude_modules as a regex.
        (
            {
                "target_modules": "all-linear",
                "exclude_modules": r".*\.1\.(self_attn|mlp)\..*",
                "init_lora_weights": True,
            },
            _LAYER[0],
            _O_MLP[0],
            _LAYER[1] | _O_MLP[1],
            r"no adapter tensors",
        ),
        # null: peft's default for llama, q_proj and v_proj.
        ({"target_modules": None}, _Q | _V, set(), set(), r"are ignored.*k_proj\.lora_B"),
    ],
    ids=["list", "regex-one-layer", "absent-and-exclude-list", "all-linear-exclude-regex", "null"],
)
def test_load_adapter_targets_what_peft_targets(
    tiny_llama, tiny_ids, qkv_adapter, tmp_path, changes, adapted, zero, stacked, warns
):
    """``adapted``: layers with the file's adapters; ``zero``: targeted layers without
    tensors (B = 0, in peft too); ``stacked``: zero adapters only edl has."""
    directory = _variant(qkv_adapter, tmp_path / "adapter", **changes)
    theirs, peft_model = _peft_load(tiny_llama, directory)
    assert theirs == adapted | zero
    with pytest.warns(UserWarning, match=warns):
        lora = load_adapter(tiny_llama, directory)
    mine = _adapted(lora)
    assert {n for n, nonzero in mine.items() if nonzero} == adapted
    assert {n for n, nonzero in mine.items() if not nonzero} == zero | stacked
    np.testing.assert_allclose(
        np.asarray(_forward(lora, tiny_ids)), _torch_logits(peft_model, tiny_ids), rtol=0, atol=TOL
    )


def test_load_adapter_rejects_what_peft_rejects(tiny_llama, qkv_adapter, tmp_path):
    cases = [  # (changes, peft's error, edl's message)
        ({"target_modules": "q_proj"}, "not found", r"'q_proj' matches no module"),
        ({"target_modules": ["mlp"]}, "is not supported", r"not linear layers.*layers\.0\.mlp"),
        (
            {"target_modules": _QKV, "exclude_modules": _QKV},
            "No modules were targeted",
            r"less exclude_modules .* leaves no module",
        ),
        # A targeted layer without tensors would get peft's random lora_B.
        ({"target_modules": [*_QKV, "o_proj"]}, None, r"without lora_A \[\] / lora_B \[.*o_proj"),
    ]
    for i, (changes, theirs, mine) in enumerate(cases):
        directory = _variant(qkv_adapter, tmp_path / str(i), **changes)
        if theirs is not None:
            with pytest.raises(
                (ValueError, peft.tuners.tuners_utils.NoMatchingPeftModuleError), match=theirs
            ):
                _peft_load(tiny_llama, directory)
        with pytest.raises(ValueError, match=mine):
            load_adapter(tiny_llama, directory)


def test_load_adapter_warns_where_peft_warns(tiny_llama, qkv_adapter, tmp_path):
    directory = _variant(
        qkv_adapter, tmp_path / "a", exclude_modules=["gate"], rank_pattern={"o_proj": 2}
    )
    for load, words in (
        (
            lambda: peft.PeftModel.from_pretrained(edl.to_torch(tiny_llama), directory),
            ("no modules were excluded", "rank_pattern keys did not match"),
        ),
        (
            lambda: load_adapter(tiny_llama, directory),
            ("exclude_modules ['gate'] excludes no module", "rank_pattern keys match no"),
        ),
    ):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            load()
        messages = [str(w.message) for w in record]
        for word in words:
            assert any(word in m for m in messages), (word, messages)
    assert any("o_proj" in m for m in messages)


@pytest.mark.slow  # two Qwen3-MoE compiles and a torch model (~17 s)
def test_adapters_peft_cannot_target_by_name_are_listed_by_module(tmp_path):
    """Qwen3-MoE keeps its dense layer (2) in a stack of its own, so LoRA on one stack's
    q_proj / v_proj with another rank on the other's cannot be said with PEFT's short names:
    ``save_adapter`` lists every adapted module by its whole name (a per-layer rank in
    ``rank_pattern``), which PEFT and edl both load to the same logits."""
    from edl.models import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig.from_hf(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "mlp_only_layers": [2],
        }
    )
    base = Qwen3MoeForCausalLM.init(config, key=jax.random.key(0))
    layers = {
        "model.layers.self_attn.q_proj": (4, 2.0),
        "model.layers.self_attn.v_proj": (4, 2.0),
        "model.dense_layers.self_attn.q_proj": (2, 1.5),
    }
    lora = _random_b(wrap_lora(base, layers, key=jax.random.key(1)))
    save_adapter(lora, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] == sorted(
        f"model.layers.{i}.self_attn.{n}"
        for i in range(4)
        for n in ("q_proj", "v_proj")
        if n == "q_proj" or i != 2
    )
    assert (saved["r"], saved["lora_alpha"]) == (4, 8)
    assert saved["rank_pattern"] == {"model.layers.2.self_attn.q_proj": 2}
    assert saved["alpha_pattern"] == {"model.layers.2.self_attn.q_proj": 3}
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    out = np.asarray(_forward(lora, ids))
    assert np.abs(out - np.asarray(_forward(base, ids))).max() > 1e-2
    loaded = peft.PeftModel.from_pretrained(edl.to_torch(base), tmp_path).eval()
    np.testing.assert_allclose(_torch_logits(loaded, ids), out, rtol=0, atol=TOL)
    again = load_adapter(base, tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
