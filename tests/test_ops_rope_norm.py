"""RoPE tables and rms_norm against transformers (torch, float32) and float64 numpy."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from edl import ops

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

HEAD_DIM = 16
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


def _hf_config(scaling, theta=500.0):
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=48,
        rope_theta=theta,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize("rope_type", list(SCALINGS))
@pytest.mark.parametrize("max_pos", [20, 200])  # 200 exceeds the original context (dynamic)
def test_rope_tables_match_transformers(rope_type, max_pos):
    hf_cfg = _hf_config(SCALINGS[rope_type])
    positions = np.stack([np.arange(max_pos - 7, max_pos), np.arange(7) * 3])
    x = torch.zeros(2, 7, HEAD_DIM)
    hf_cos, hf_sin = modeling_llama.LlamaRotaryEmbedding(hf_cfg)(x, torch.tensor(positions))

    # transformers 5 writes rope_parameters; transformers 4 configs have rope_scaling.
    for cfg_dict in (
        hf_cfg.to_dict(),
        {"rope_theta": 500.0, "rope_scaling": SCALINGS[rope_type], "max_position_embeddings": 48},
    ):
        cfg = ops.RopeConfig.from_hf(cfg_dict, HEAD_DIM)
        assert cfg.rope_type == rope_type
        cos, sin = ops.rope_tables(jnp.asarray(positions), cfg)
        # float32 angles up to ~200 rad: a few ulps of the angle.
        np.testing.assert_allclose(cos, hf_cos.numpy(), atol=2e-5)
        np.testing.assert_allclose(sin, hf_sin.numpy(), atol=2e-5)


def test_rope_config_errors():
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ops.RopeConfig.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 16)
    with pytest.raises(ValueError, match="llama3' needs original_max_position_embeddings"):
        ops.RopeConfig(dim=16, rope_type="llama3")
    with pytest.raises(ValueError, match="positive even"):
        ops.RopeConfig(dim=7)


@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 16]))
def test_apply_rope_matches_transformers(seed, rot_dim):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, 5, 3, 16)).astype(np.float32)
    positions = rng.integers(0, 100, size=(2, 5))
    cos, sin = ops.rope_tables(jnp.asarray(positions), ops.RopeConfig(dim=rot_dim))
    out = np.asarray(ops.apply_rope(jnp.asarray(q), cos, sin))
    # HF layout is (batch, heads, seq, dim); partial rotary rotates the first rot_dim features.
    tq = torch.tensor(q).transpose(1, 2)
    rot, _ = modeling_llama.apply_rotary_pos_emb(
        tq[..., :rot_dim],
        tq[..., :rot_dim],
        torch.tensor(np.asarray(cos)),
        torch.tensor(np.asarray(sin)),
    )
    np.testing.assert_allclose(out[..., :rot_dim], rot.transpose(1, 2).numpy(), atol=1e-6)
    np.testing.assert_array_equal(out[..., rot_dim:], q[..., rot_dim:])


@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 1.0]))
def test_rms_norm_matches_float64(seed, offset):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 4, 32)) * rng.uniform(0.1, 10)
    w = rng.normal(size=(32,))
    ref = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * (offset + w)
    out = ops.rms_norm(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6, offset=offset
    )
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_bf16_rounds_like_transformers():
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(2, 8, 64)), dtype=torch.bfloat16)
    w = torch.tensor(rng.normal(size=(64,)), dtype=torch.bfloat16)
    hf = modeling_llama.LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data = w
    expected = hf(x).detach().float().numpy()
    out = ops.rms_norm(
        jnp.asarray(x.float().numpy(), jnp.bfloat16),
        jnp.asarray(w.float().numpy(), jnp.bfloat16),
        1e-5,
    )
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    with pytest.raises(ValueError, match=r"weight shape \(3,\) does not match x's last dim 64"):
        ops.rms_norm(jnp.ones((2, 64)), jnp.ones(3), 1e-5)
