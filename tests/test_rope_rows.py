"""Length-dependent RoPE (``longrope``, ``dynamic``) per row (``RunOptions.rope_length``):
each row's tables equal that row's alone, and the serving engine, which batches independent
requests, gives a short Phi-3 request the same tokens beside a request past LongRoPE's
original context as alone (with the batch's length it would switch to the long factors)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.generate import generate
from edl.models import Phi3Config, Phi3ForCausalLM
from edl.ops.rope import RopeConfig, rope_tables
from edl.serve import Engine, SamplingParams

ROPES = {
    "longrope": RopeConfig(
        rope_type="longrope",
        dim=8,
        factor=8.0,  # max_position_embeddings 64 / original 8
        original_max_position_embeddings=8,
        short_factor=(1.0, 1.1, 1.2, 1.3),
        long_factor=(1.0, 2.0, 4.0, 6.0),
    ),
    "dynamic": RopeConfig(
        rope_type="dynamic", dim=8, factor=2.0, original_max_position_embeddings=8
    ),
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_per_row_tables_equal_each_row_alone(name):
    config = ROPES[name]
    positions = jnp.asarray([[0, 1, 2, 3], [20, 21, 22, 23]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 0]], jnp.int32)  # row 1's last slot: padding
    cos, sin = rope_tables(positions, config, valid, per_row=True)
    for row in range(2):
        alone = rope_tables(positions[row : row + 1], config, valid[row : row + 1])
        np.testing.assert_array_equal(cos[row], alone[0][0])
        np.testing.assert_array_equal(sin[row], alone[1][0])
    batched, _ = rope_tables(positions, config, valid)
    assert np.abs(np.asarray(batched[0] - cos[0])).max() > 1e-3  # the batch's rule differs


@pytest.mark.slow  # two engines compile their steps (~20 s)
def test_a_short_request_ignores_a_long_neighbour_in_the_engine():
    config = Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope=ROPES["longrope"],
    )
    model = Phi3ForCausalLM.init(config, key=jax.random.key(3))
    model = jax.tree.map(lambda x: x * 4 if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
    short, long = [5, 9, 12], list(range(1, 21))
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def serve(prompts):
        engine = Engine(model, max_batch=2, max_model_len=32, page_size=8)
        ids = [engine.add_request(p, params) for p in prompts]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[i] for i in ids]

    alone = generate(model, jnp.asarray([short]), max_new_tokens=4, do_sample=False)
    want = np.asarray(alone.sequences[0, 3:]).tolist()
    assert serve([short]) == [want]
    assert serve([short, long])[0] == want
