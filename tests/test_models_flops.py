"""``flops_per_token`` against the matmuls a forward pass actually runs.

The reference walks the jaxpr of a one-token forward (so causal and full attention see the
same single key) and sums ``2 * out * contraction`` over its ``dot_general`` and
``ragged_dot_general`` equations, times the trip count of the scans over layers, taking one
branch of each ``cond``. With ``moe_impl="ragged"`` only the routed experts' rows are
multiplied. Tolerance 1%: the jaxpr also holds a few tiny dots that are weighted sums, not
projections (the MoE combine over the top-k, the router statistics), about 0.6% of these
tiny models' counts.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

import edl.models as M
from edl.models import flops_per_token


def _dot_flops(jaxpr, trips=1):
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
        elif name == "ragged_dot_general":
            (contract, _), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
        if name in ("dot_general", "ragged_dot_general"):
            lhs = eqn.invars[0].aval.shape
            out = math.prod(eqn.outvars[0].aval.shape)
            total += 2 * out * math.prod(lhs[i] for i in contract) * trips
        if name == "cond":  # alternatives (host checks, platform choices): one runs
            total += min(_dot_flops(b.jaxpr, trips) for b in eqn.params["branches"])
            continue
        for sub in jcore.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub, trips * (eqn.params["length"] if name == "scan" else 1))
    return total


COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
)
MOE = dict(num_experts=4, num_experts_per_tok=2)
CASES = {
    "llama": lambda: (M.LlamaForCausalLM, M.LlamaConfig(**COMMON)),
    "mixtral": lambda: (M.MixtralForCausalLM, M.MixtralConfig(**COMMON, **MOE)),
    "gpt_oss": lambda: (M.GptOssForCausalLM, M.GptOssConfig(**COMMON, **MOE, head_dim=8)),
    "deepseek_v3": lambda: (
        M.DeepseekV3ForCausalLM,
        M.DeepseekV3Config(
            **{**COMMON, **MOE, "num_key_value_heads": 4},
            moe_intermediate_size=24,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
    ),
    "qwen3_next": lambda: (
        M.Qwen3NextForCausalLM,
        M.Qwen3NextConfig(
            **COMMON,
            **MOE,
            head_dim=8,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=20,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=("linear_attention", "full_attention", "linear_attention"),
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flops_per_token_counts_the_forward_matmuls(name):
    cls, config = CASES[name]()
    config = config.replace(moe_impl="ragged", attention_impl="xla")
    # Shapes are all a jaxpr needs.
    model = eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0), dtype=jnp.float32)
    ids = jnp.ones((1, 1), jnp.int32)
    counted = _dot_flops(jax.make_jaxpr(lambda m, x: m(x).logits)(model, ids).jaxpr)
    if name == "qwen3_next":
        # A one-token delta-rule step does its rank-1 state update k v^T elementwise.
        c = config
        outer = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        counted += 2 * outer * c.layer_types.count("linear_attention")
    assert flops_per_token(config, 1, training=False) == pytest.approx(counted, rel=0.01)
    assert flops_per_token(config, 1) == 3 * flops_per_token(config, 1, training=False)
