"""Gated DeltaNet (``edl.nn.gated_deltanet``) on packed sequences: each segment's output is
the segment's alone (the causal conv reads no input of another segment, the delta rule
restarts its state). The whole model's packed logits are checked in
tests/test_models_qwen3_next.py (slow set)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from edl.nn.gated_deltanet import GatedDeltaNet


def test_packed_segments_equal_each_segment_alone():
    layer = eqx.filter_jit(GatedDeltaNet.init)(
        8,
        num_k_heads=1,
        num_v_heads=2,
        head_k_dim=4,
        head_v_dim=4,
        conv_kernel=4,
        eps=1e-6,
        std=0.5,
        key=jax.random.key(0),
    )
    lengths = (2, 5, 3)  # shorter and longer than the conv's reach of 3 inputs back
    x = jax.random.normal(jax.random.key(1), (1, sum(lengths), 8))
    segments = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None])
    # Alone: one right-padded batch (padding after a segment changes none of its outputs).
    starts = np.cumsum((0, *lengths))
    alone_x = np.zeros((len(lengths), max(lengths), 8), np.float32)
    mask = np.zeros((len(lengths), max(lengths)), np.float32)
    for i, n in enumerate(lengths):
        alone_x[i, :n], mask[i, :n] = x[0, starts[i] : starts[i] + n], 1

    @jax.jit  # one program: packed, alone, and the row unpacked
    def run(x, segments, alone_x, mask):
        return layer(x, segments=segments), layer(alone_x, mask), layer(x)

    packed, alone, plain = run(x, segments, jnp.asarray(alone_x), jnp.asarray(mask))
    for i, n in enumerate(lengths):
        got = packed[0, starts[i] : starts[i] + n]
        np.testing.assert_allclose(got, alone[i, :n], rtol=1e-5, atol=1e-6, err_msg=str(i))
    # Unpacked, the later segments differ (the check above is not vacuous).
    assert not np.allclose(plain[0, starts[1] :], packed[0, starts[1] :], atol=1e-3)
