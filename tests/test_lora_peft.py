"""PEFT interop: adapters written by edl load in peft + transformers with the same logits and
the same file layout peft itself writes; adapters written by peft (rank/alpha patterns,
rsLoRA, an adapted LM head) load in edl with the same logits.

Tolerance: float32 forward passes of a 2-layer model with dims <= 64 in torch and XLA
differ by ~1e-6 relative (summation order); 1e-4 absolute on logits of size ~1 leaves room
for that and nothing else (the adapters move the logits by > 1e-2).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import edl
from edl.io.safetensors import load_file, save_file
from edl.lora import apply_lora, load_adapter, lora_params, save_adapter

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
    lora = apply_lora(tiny_llama, rank=4, alpha=8, pattern=r"(q|k|v|o|gate|up)_proj$",
                      key=jax.random.key(2))  # fmt: skip
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
    theirs = peft.get_peft_model(edl.to_torch(tiny_llama), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", **patterns))  # fmt: skip
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
    for a, b in zip(jax.tree.leaves(lora_params(again)), jax.tree.leaves(lora_params(lora)),
                    strict=True):  # fmt: skip
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
        r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        init_lora_weights=False, task_type="CAUSAL_LM", **options,
    )  # fmt: skip
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

    tensors = load_file(tmp_path, prefix="adapter_model")
    del tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"1 missing keys:\n  model\.layers\.1\.self_attn"):
        load_adapter(tiny_llama, tmp_path)

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match=r"unsupported PEFT options \['use_dora'\]"):
        load_adapter(tiny_llama, tmp_path)
