"""LoRA on MoE expert weights (PEFT's ``target_parameters``): adapters PEFT trained load in edl
with PEFT's logits, edl's load in PEFT with edl's and PEFT's own key names and shapes, merge
folds them, training touches nothing else, and a target that names no weight is refused.

Tolerance as in ``test_lora_peft``: float32 forward passes of a 2-layer model with dims <= 48
in torch and XLA differ by ~1e-7 here; 1e-4 on logits leaves room for that and nothing else
(the adapters move the logits by > 1e-2).
"""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
import edl.models as M
from edl.io.formats.manifest import describe
from edl.io.formats.peft import load_adapter, save_adapter
from edl.io.formats.peft_experts import expert_weights
from edl.io.formats.safetensors import load_file
from edl.lora import (
    apply_lora,
    expert_parameters,
    lora_experts,
    lora_params,
    lora_trainable,
    merge_lora,
    unwrap_lora,
)
from edl.nn.lora_experts import EXPERT_PARAMS, LoraExperts, hf_param
from edl.train import make_train_step

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOL = 1e-4
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
SMALL = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": lambda: (M.MixtralForCausalLM, M.MixtralConfig(**SMALL)),
    "gpt_oss": lambda: (M.GptOssForCausalLM, M.GptOssConfig(**SMALL, head_dim=8)),
    "qwen3_moe": lambda: (
        M.Qwen3MoeForCausalLM,
        M.Qwen3MoeConfig(**SMALL, head_dim=8, moe_intermediate_size=12),
    ),
    "deepseek_v3": lambda: (
        M.DeepseekV3ForCausalLM,
        M.DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 2},
            moe_intermediate_size=12,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
    ),
    "qwen3_next": lambda: (
        M.Qwen3NextForCausalLM,
        M.Qwen3NextConfig(
            **SMALL,
            head_dim=8,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=10,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=("linear_attention", "full_attention"),
        ),
    ),
}
DEFAULT = ["mixtral", "gpt_oss"]
SLOW = [pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3_moe", "deepseek_v3", "qwen3_next")]

_forward = jax.jit(lambda m, i: m(i).logits)
IDS = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8]])


def _random(cls, config):
    """A tiny model with weights drawn in numpy (no per-shape compiles of an eager init);
    ``N(0, 0.3)`` makes the experts and their adapters move the logits as a trained model's
    do, norm scales ``1 + N(0, 0.3)``."""
    shapes = eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0))
    rng = np.random.default_rng(0)

    def one(path, s):
        x = 0.3 * rng.normal(size=s.shape)
        return jnp.asarray(x + 1 if "norm" in path else x, s.dtype)

    return edl.tree.named_map(one, shapes)


@pytest.fixture(scope="module", params=[*DEFAULT, *SLOW])
def base(request):
    return _random(*FAMILIES[request.param]())


@pytest.fixture(scope="module")
def lora(base):
    """``base`` with expert and o_proj adapters as if trained (nonzero B)."""
    return _edl_lora(base)


def _torch_logits(torch_model):
    with torch.no_grad():
        return torch_model(torch.from_numpy(IDS.astype(np.int64))).logits.numpy()


def _trained_b(model, scale=0.5):
    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(scale * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


# One adapter configuration for both directions: the LoRA'd models share a structure, so
# the forward compiles once per family.
RANK, ALPHA, LINEAR = 2, 3, ["o_proj"]


def _peft_config(**kwargs):
    return peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=LINEAR,
        target_parameters=EXPERTS,
        use_rslora=True,
        **kwargs,
    )


def _edl_lora(base):
    lora = apply_lora(
        base,
        rank=RANK,
        alpha=ALPHA,
        use_rslora=True,
        target_parameters=EXPERTS,
        key=jax.random.key(1),
    )
    lora = apply_lora(
        lora, rank=RANK, alpha=ALPHA, use_rslora=True, pattern="o_proj$", key=jax.random.key(2)
    )
    return _trained_b(lora)


def _hf_params(model):
    """Every expert weight of ``model`` by its HF name (``model.layers.1.mlp.experts
    .down_proj``), as a numpy array."""
    table = describe(model).module_table()
    experts = edl.tree.find(model, lambda x: type(x) in EXPERT_PARAMS)
    return {
        full: np.asarray(hf_param(experts[path], name)[index])
        for full, (path, name, index) in expert_weights(model, table).items()
    }


def test_peft_trained_expert_adapters_load_in_edl_with_peft_logits(base, tmp_path):
    """A PEFT adapter with nonzero B everywhere (``init_lora_weights=False``), rsLoRA and a
    linear target beside the expert weights: edl's logits are PEFT's, and so are the
    weights ``merge_lora`` folds (PEFT's ``merge_and_unload``)."""
    torch.manual_seed(0)
    theirs = peft.get_peft_model(edl.to_torch(base), _peft_config(init_lora_weights=False))
    theirs.eval().save_pretrained(tmp_path)
    want = _torch_logits(theirs)
    lora = load_adapter(base, tmp_path)
    assert isinstance(lora.model.layers.mlp.experts, LoraExperts)
    assert lora.model.layers.mlp.experts.adapters["down_proj"].scaling == ALPHA / np.sqrt(RANK)
    np.testing.assert_allclose(np.asarray(_forward(lora, IDS)), want, rtol=0, atol=TOL)
    merged = merge_lora(lora)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    folded = theirs.merge_and_unload().state_dict()
    mine = _hf_params(merged)
    assert mine
    for name, weight in mine.items():
        np.testing.assert_allclose(weight, folded[name].numpy(), rtol=0, atol=1e-5)


# GPT-OSS's edl -> PEFT direction runs in the slow set (its forward's compile, ~6 s on the
# shared 2-core VM); its PEFT -> edl direction, HF's GPT-OSS recipe's, in the default suite.
@pytest.mark.parametrize(
    "base", ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow), *SLOW], indirect=True
)
def test_edl_expert_adapters_load_in_peft_with_edl_logits(base, lora, tmp_path):
    mine = np.asarray(_forward(lora, IDS))
    assert np.abs(mine - _torch_logits(edl.to_torch(base))).max() > 1e-2  # they matter
    save_adapter(lora, tmp_path / "edl")
    config = json.loads((tmp_path / "edl" / "adapter_config.json").read_text())
    assert config["target_parameters"] == sorted(EXPERTS)
    assert config["target_modules"] == LINEAR
    loaded = peft.PeftModel.from_pretrained(edl.to_torch(base), tmp_path / "edl").eval()
    np.testing.assert_allclose(_torch_logits(loaded), mine, rtol=0, atol=TOL)
    # PEFT's own file for the same configuration: the same keys, shapes and dtypes.
    theirs = peft.get_peft_model(edl.to_torch(base), _peft_config())
    theirs.save_pretrained(tmp_path / "peft")
    files = [load_file(tmp_path / d, prefix="adapter_model") for d in ("edl", "peft")]
    assert [{k: (v.shape, v.dtype) for k, v in f.items()} for f in files[:1]] == [
        {k: (v.shape, v.dtype) for k, v in files[1].items()}
    ]
    again = load_adapter(base, tmp_path / "edl")
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_only_the_expert_adapters_are_trainable(lora):
    adapters = {p for p, x in edl.tree.flatten(lora_params(lora)).items() if x is not None}
    experts = lora_experts(lora)
    assert experts and {p for p in adapters if ".experts.adapters." in p} == {
        f"{path}.adapters.{n}.lora_{f}.weight"
        for path in experts
        for n in ("down_proj", "gate_up_proj")
        for f in "AB"
    }
    assert all(".experts.adapters." in p or ".o_proj.lora_" in p for p in adapters)
    state = edl.create_state(lora, optax.adam(1e-2), trainable=lora_trainable)
    moments = {p.split("mu.", 1)[1] for p in edl.tree.flatten(state.opt_state) if ".mu." in p}
    assert moments == adapters


@pytest.mark.slow  # a train step's compile per family (~20 s each on the 2-core VM)
def test_a_gradient_step_changes_only_the_adapters(base, lora):
    # nonzero B: A gets a gradient too
    before = {p: np.asarray(x) for p, x in edl.tree.flatten(lora).items() if hasattr(x, "shape")}
    tx = optax.adam(1e-2)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    step = make_train_step(lambda m, b: m.compute_loss(b["input_ids"]), tx)
    state, _ = step(state, {"input_ids": jnp.asarray(np.tile(IDS, (2, 1)))})
    after = edl.tree.flatten(edl.state.model(state))
    changed = {p for p, x in before.items() if not np.array_equal(x, np.asarray(after[p]))}
    assert changed == {p for p in before if lora_trainable.search(p)}
    restored = unwrap_lora(edl.state.model(state))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_target_parameter_that_names_no_weight_is_refused(tmp_path):
    model = _random(*FAMILIES["mixtral"]())
    assert sorted(expert_parameters(model)) == [
        "model.layers.mlp.experts.down_proj",
        "model.layers.mlp.experts.gate_up_proj",
    ]
    with pytest.raises(ValueError, match=r"'experts\.w1' matches no expert weight.*gate_up_proj"):
        apply_lora(model, rank=2, alpha=4, target_parameters=["experts.w1"], key=jax.random.key(0))
    with pytest.raises(ValueError, match="no dropout on expert weights"):
        apply_lora(
            model, rank=2, alpha=4, target_parameters=EXPERTS, dropout=0.1, key=jax.random.key(0)
        )
    lora = _trained_b(
        apply_lora(model, rank=2, alpha=4, target_parameters=EXPERTS, key=jax.random.key(0))
    )
    save_adapter(lora, tmp_path)
    file = tmp_path / "adapter_config.json"
    saved = json.loads(file.read_text())
    file.write_text(json.dumps({**saved, "target_parameters": ["mlp.experts.w2"]}))
    with pytest.raises(ValueError, match=r"\['mlp\.experts\.w2'\] match no expert weight"):
        load_adapter(model, tmp_path)
    file.write_text(json.dumps({**saved, "target_parameters": ["experts.down_proj"]}))
    # down_proj alone is the outermost wrapper: its keys lose the ".base_layer" level, so
    # the file's keys for the two adapters no longer fit what the config targets.
    with pytest.raises(
        ValueError, match=r"do not name.*layers\.0\.mlp\.experts\.base_layer\.lora_A"
    ):
        load_adapter(model, tmp_path)


def test_edl_model_files_refuse_expert_adapters_rather_than_write_unreadable_ones(tmp_path):
    from edl.io.model_files import write_model_files

    model = _random(*FAMILIES["mixtral"]())
    lora = apply_lora(model, rank=2, alpha=4, target_parameters=EXPERTS, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"model\.layers\.mlp\.experts.*save_adapter"):
        write_model_files(lora, tmp_path)
    assert not any(tmp_path.iterdir())


def test_expert_weights_under_adapters_shard_as_without_them(base, lora):
    """The partition rules see through ``base_layer``: a LoRA'd model's expert weights are
    split over ``expert`` / ``tp`` / ``fsdp`` as the plain model's are."""
    from edl.sharding import make_mesh, partition_specs

    mesh = make_mesh((1, -1, 1, 1, 2))  # (dp, fsdp, tp, sp, expert)
    plain = edl.tree.flatten(partition_specs(base, None, mesh=mesh))
    wrapped = edl.tree.flatten(partition_specs(lora, None, mesh=mesh))
    experts = {p: s for p, s in plain.items() if ".experts." in p}
    assert experts and all(s[1] == "expert" for s in experts.values())
    for path, spec in experts.items():
        assert wrapped[path.replace(".experts.", ".experts.base_layer.")] == spec
