"""RoPE tables and rms_norm against transformers (torch, float32) and float64 numpy."""

import dataclasses

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


_RNG = np.random.default_rng(7)
_SHORT, _LONG = _RNG.uniform(1.0, 1.5, HEAD_DIM // 2), _RNG.uniform(1.0, 8.0, HEAD_DIM // 2)
_PARTIAL_SHORT = _RNG.uniform(1.0, 1.5, HEAD_DIM // 4)
_PARTIAL_LONG = _RNG.uniform(1.0, 8.0, HEAD_DIM // 4)
# Each yarn / longrope knob HF reads, over the original context of 16 (max_position 48).
EXTENDED = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_knobs": {
        "rope_type": "yarn",
        "factor": 2.5,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn_mscale": {  # DeepSeek-V3's spelling: a ratio of two mscale terms
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 0.8,
        "partial_rotary_factor": 0.5,
    },
    # transformers 5 grows dynamic's base past max_position_embeddings, ignoring this key.
    "dynamic_original": {
        "rope_type": "dynamic",
        "factor": 2.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {  # no factor: HF's max_position / original = 3
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "short_factor": _SHORT.tolist(),
        "long_factor": _LONG.tolist(),
    },
    "longrope_factors": {
        "rope_type": "longrope",
        "factor": 6.0,
        "attention_factor": 1.3,
        "original_max_position_embeddings": 16,
        "short_factor": _PARTIAL_SHORT.tolist(),
        "long_factor": _PARTIAL_LONG.tolist(),
        "partial_rotary_factor": 0.5,
    },
}


@pytest.mark.parametrize("name", list(EXTENDED))
def test_extended_rope_matches_transformers(name):
    """yarn, longrope and dynamic with a stated original context: inverse frequencies and
    attention factor from transformers' own functions, and the cos / sin tables of its
    rotary module on both sides of the original context (longrope switches from short to
    long factors past it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 500.0, **EXTENDED[name]}
    hf_cfg = _hf_config(None)
    hf_cfg.rope_parameters = dict(params)
    cfg = ops.RopeConfig.from_hf(hf_cfg.to_dict(), HEAD_DIM)
    assert cfg.rope_type == params["rope_type"]
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    for seq_len in (None, 12, 17, 40, 60):
        hf_inv, hf_scale = init(hf_cfg, None, seq_len=seq_len)
        np.testing.assert_allclose(
            ops.rope.inv_frequencies(cfg, seq_len), hf_inv.numpy(), rtol=1e-6
        )
        assert cfg.attention_scaling == pytest.approx(hf_scale, rel=1e-12)
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    for top in (10, 16, 17, 40):
        positions = np.stack([np.arange(top - 7, top), np.arange(7) * (top // 7)])
        hf_cos, hf_sin = rotary(torch.zeros(2, 7, HEAD_DIM), torch.tensor(positions))
        cos, sin = ops.rope_tables(jnp.asarray(positions), cfg)
        np.testing.assert_allclose(cos, hf_cos.numpy(), atol=2e-6)
        np.testing.assert_allclose(sin, hf_sin.numpy(), atol=2e-6)
    # Written back, transformers reads the same parameters.
    again = ops.RopeConfig.from_hf(
        {
            "max_position_embeddings": 48,
            "rope_parameters": {
                **cfg.hf_parameters(),
                **(
                    {"partial_rotary_factor": params["partial_rotary_factor"]}
                    if "partial_rotary_factor" in params
                    else {}
                ),
            },
        },
        HEAD_DIM,
    )
    assert again == cfg


def test_rope_types_are_a_registry():
    """A new scaling is one entry: configs read, run and write it with nothing else changed."""
    toy = ops.rope.RopeType(
        "toy_halved",
        lambda c, s: ops.rope.inv_frequencies(dataclasses.replace(c, rope_type="default")) / 2,
        read=lambda p, c: {"factor": 2.0},
        write=lambda c: {"factor": c.factor},
    )
    with ops.rope.ROPE_TYPES.registered(toy):
        cfg = ops.RopeConfig.from_hf({"rope_parameters": {"rope_type": "toy_halved"}}, 8)
        assert cfg.hf_parameters() == {
            "rope_type": "toy_halved",
            "rope_theta": 10000.0,
            "factor": 2.0,
        }
        cos, _ = ops.rope_tables(jnp.asarray([[4]]), cfg)
        ref, _ = ops.rope_tables(jnp.asarray([[2]]), ops.RopeConfig(dim=8))
        np.testing.assert_allclose(cos, ref, rtol=1e-6)
    with pytest.raises(ValueError, match="unsupported rope type 'toy_halved'"):
        ops.RopeConfig(dim=8, rope_type="toy_halved")


def test_rope_config_errors():
    with pytest.raises(ValueError, match="unsupported rope type 'proportional'"):
        ops.RopeConfig.from_hf({"rope_scaling": {"rope_type": "proportional"}}, 16)
    with pytest.raises(ValueError, match="short_factor must be a list of numbers"):
        ops.RopeConfig.from_hf(
            {"rope_parameters": {"rope_type": "longrope", "short_factor": [1, "x"]}}, 16
        )
    with pytest.raises(ValueError, match=r"long_factor needs dim // 2 = 8 entries, got 3"):
        ops.RopeConfig(
            dim=16,
            rope_type="longrope",
            original_max_position_embeddings=4,
            short_factor=(1.0,) * 8,
            long_factor=(1.0,) * 3,
        )
    with pytest.raises(ValueError, match="truncate must be true or false"):
        ops.RopeConfig.from_hf(
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "truncate": 1}}, 16
        )
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
