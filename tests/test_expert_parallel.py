"""Expert parallelism on the 8 forced host devices: the ``expert`` mesh axis, the dispatch of
``edl.ops.expert_parallel`` (padded all-to-all on CPU; the ragged form through an emulated
``ragged_all_to_all``, since XLA:CPU has none), equal to one device in float64, and MoE
families' losses and gradients with experts split equal to the single-device run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import edl
import edl.ops.expert_parallel as ep
from edl._mesh_spec import MeshSpec
from edl.models import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from edl.ops.moe import expert_mlp
from edl.sharding import make_mesh, partition_specs, shard, shard_batch
from edl.train import make_train_step

E, D, W, K = 8, 16, 12, 2  # experts, hidden, expert width, experts per token


def _expert_inputs(dtype=jnp.float64):
    """Tokens ``(8, 6, dim)``, each token's top-``K`` routing (uneven loads) and the experts'
    weights; built in numpy (jax's eager random ops would compile one program each)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape)
    x, gate, up, down = normal(8, 6, D), normal(E, W, D), normal(E, W, D), normal(E, D, W)
    logits = 3.0 * normal(48, E)
    chosen = np.argsort(-logits, axis=-1)[:, :K]
    top = np.take_along_axis(logits, chosen, axis=-1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    arrays = (x, weights, 0.2 * gate, 0.2 * up, 0.2 * down)
    x, weights, gate, up, down = (jnp.asarray(a, dtype) for a in arrays)
    return x, weights, jnp.asarray(chosen, jnp.int32), gate, up, down


def _value_and_grads(fn, x, weights, gate, up, down):
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)


def _dense(chosen):
    return lambda x, w, g, u, d: expert_mlp(x.reshape(-1, D), w, chosen, g, u, d, impl="dense")


def _routed(chosen, **kw):
    return lambda x, w, g, u, d: ep.routed_expert_mlp(x, w, chosen, g, u, d, **kw)


def _assert_close(got, want, tol=1e-12):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` as its docstring defines it, from an all_gather."""
    me = jax.lax.axis_index(axis_name)
    everyone = jax.lax.all_gather(operand, axis_name)
    gathered = (input_offsets, send_sizes, output_offsets)
    start, size, at = (jax.lax.all_gather(a, axis_name)[:, me] for a in gathered)
    p = jnp.arange(output.shape[0], dtype=jnp.int32)
    for src in range(everyone.shape[0]):
        inside = (p >= at[src]) & (p < at[src] + size[src])
        rows = everyone[src][jnp.clip(start[src] + p - at[src], 0, operand.shape[0] - 1)]
        output = jnp.where(inside[:, None], rows, output)
    return output


def _dispatch_and_reference(dims, with_grads, platforms=("cpu",)):
    """The dispatch's result on mesh ``dims``, the dense single-device one (float64) and
    the dispatch's program as lowered for each of ``platforms``."""
    with jax.enable_x64(True):
        x, weights, chosen, gate, up, down = _expert_inputs()
        args = (x, weights, gate, up, down)
        dense, routed = _dense(chosen), _routed(chosen)
        want = _value_and_grads(dense, *args) if with_grads else jax.jit(dense)(*args)
        with jax.set_mesh(make_mesh(dims)):
            got = _value_and_grads(routed, *args) if with_grads else jax.jit(routed)(*args)
            traced = jax.jit(routed).trace(*args)
            texts = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in platforms}
    return got, want, texts


def test_dispatch_equals_one_device_with_tp_inside_experts():
    """Expert = 4 with tp = 2 splitting each expert's width: the dispatched MoE equals the
    dense single-device reference to float64 rounding, through an all-to-all on CPU; the
    same program lowered for TPUs takes the ragged all-to-all instead."""
    got, want, texts = _dispatch_and_reference((1, 1, 2, 1, 4), False, ("cpu", "tpu"))
    _assert_close(got, want)
    assert "all_to_all" in texts["cpu"] and "ragged_all_to_all" not in texts["cpu"]
    assert "ragged_all_to_all" in texts["tpu"]


@pytest.mark.slow  # ~5-7 s each: an 8-device program and its gradient compiled
@pytest.mark.parametrize("form", ["padded", "ragged"])
@pytest.mark.parametrize("dims", [(1, 2, 1, 1, 4), (1, 1, 2, 1, 4), (1, 1, 1, 1, 8)])
def test_dispatch_and_its_gradients_equal_one_device_in_float64(dims, form, monkeypatch):
    """Output and gradients (tokens, routing weights, the three expert weights) of the
    dispatch over expert = 4 (with fsdp = 2, or tp = 2 inside each expert) or 8 equal the
    dense single-device reference to float64 rounding; ``"ragged"`` runs the GPU / TPU
    form's offsets on CPU through an emulated ragged all-to-all."""
    if form == "ragged":
        monkeypatch.setattr(ep, "_ragged_all_to_all", _emulated_ragged_all_to_all)
        monkeypatch.setattr(ep, "platform_dependent", lambda *a, default, **_: default(*a))
    got, want, texts = _dispatch_and_reference(dims, True)
    _assert_close(got, want)
    # the experts really were dispatched (the emulated ragged form gathers)
    assert ("all_to_all" if form == "padded" else "all_gather") in texts["cpu"]


@pytest.mark.slow  # ~6 s
def test_capacity_factor_drops_beyond_each_pair_of_devices():
    """With ``capacity_factor`` a device sends at most ``ceil(tokens * k / n * factor)`` rows
    to each device: a large factor drops nothing (equal to the reference), a small one drops
    some assignments (their outputs zero), as the ``"capacity"`` impl drops."""
    with jax.enable_x64(True):
        x, weights, chosen, gate, up, down = _expert_inputs()
        want = _dense(chosen)(x, weights, gate, up, down)
        with jax.set_mesh(make_mesh((2, 1, 1, 1, 4))):
            big = jax.jit(_routed(chosen, capacity_factor=4.0))(x, weights, gate, up, down)
            small = jax.jit(_routed(chosen, capacity_factor=0.25))(x, weights, gate, up, down)
    _assert_close(big, want)
    dropped = np.abs(np.asarray(small - want)).max(-1) > 1e-9
    assert 0 < dropped.sum() < dropped.size


@pytest.mark.parametrize(
    ("platform", "capacity_factor"),
    [
        ("cuda", None),  # ~1 s; the others in the slow set
        *[
            pytest.param(p, c, marks=pytest.mark.slow)
            for p, c in [("tpu", None), ("cpu", None), ("cuda", 1.25), ("tpu", 1.25), ("cpu", 1.25)]
        ],
    ],
)
def test_dispatch_and_its_gradient_lower_for_every_platform(platform, capacity_factor):
    """From this CPU host, exact programs for GPUs and TPUs take the ragged all-to-all
    (forward and backward); for CPU, and with a capacity factor everywhere, the padded
    all-to-all and no ragged one."""
    x, weights, chosen, gate, up, down = _expert_inputs(jnp.float32)
    loss = lambda *a: jnp.sum(_routed(chosen, capacity_factor=capacity_factor)(*a))
    with jax.set_mesh(make_mesh((1, 1, 1, 1, 8))):
        text = (
            jax.jit(jax.grad(loss, argnums=(0, 2)))
            .trace(x, weights, gate, up, down)
            .lower(lowering_platforms=(platform,))
            .as_text()
        )
    ragged = platform != "cpu" and capacity_factor is None
    assert ("ragged_all_to_all" in text) == ragged
    assert "all_to_all" in text


def test_without_an_expert_axis_the_layer_runs_as_before():
    """expert = 1, an axis that does not divide the experts or the batch, or a 4-axis mesh
    built with the older names: no dispatch (``expert_parallel`` returns None)."""
    x, weights, chosen = jnp.zeros((8, 6, D)), jnp.zeros((8, 6, K)), jnp.zeros((8, 6, K), int)
    args = (x, weights, chosen, (jnp.zeros((E, W, D)),) * 3)
    specs = (P("expert"),) * 3
    local = lambda *a: a[0]
    assert ep.expert_parallel(*args, specs, local, num_experts=E) is None  # no mesh
    old = jax.make_mesh((2, 4, 1, 1), ("dp", "fsdp", "tp", "sp"))
    for mesh, experts in [(make_mesh((1, 8, 1, 1)), E), (make_mesh((1, 1, 1, 1, 8)), 6), (old, E)]:
        with jax.set_mesh(mesh):
            assert ep.expert_parallel(*args, specs, local, num_experts=experts) is None
    with jax.set_mesh(make_mesh((1, 1, 1, 1, 8))):
        assert ep.token_spec((4, 6, D)) is None  # 4 rows cannot split over 8
        assert ep.token_spec((8, 6, D)) == P(("dp", "fsdp", "expert"), "sp", None)


@pytest.mark.parametrize(
    ("spec", "ici", "dcn"),
    [("1,2,1,1,4", (1, 2, 1, 1, 4), None), ("1,-1,1,1,2/2", (1, -1, 1, 1, 2), (2, 1, 1, 1))],
)
def test_mesh_specs_take_an_expert_size(spec, ici, dcn):
    parsed = MeshSpec.parse(spec)
    assert (parsed.ici, parsed.dcn) == (ici, dcn)
    with pytest.raises(ValueError, match="DP,FSDP,TP,SP\\[,EXPERT\\]"):
        MeshSpec.parse("1,1,1,1,1,1")


def test_make_mesh_has_an_expert_axis_of_size_one_by_default():
    assert dict(make_mesh((1, -1, 1, 1)).shape) == {
        "dp": 1,
        "fsdp": 8,
        "tp": 1,
        "sp": 1,
        "expert": 1,
    }
    assert make_mesh((1, 2, 1, 1, -1)).shape["expert"] == 4
    assert make_mesh(MeshSpec.parse("2,1,1,1,4").ici).shape["expert"] == 4


# -- MoE families ---------------------------------------------------------------------------

_COMMON = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8
)
FAMILIES = {
    "mixtral": lambda: MixtralForCausalLM.init(
        MixtralConfig(
            **_COMMON,
            intermediate_size=32,
            num_key_value_heads=2,
            num_experts=8,
            output_router_logits=True,
        ),
        key=jax.random.key(0),
    ),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM.init(
        Qwen3MoeConfig(
            **_COMMON,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            output_router_logits=True,
        ),
        key=jax.random.key(0),
    ),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM.init(
        DeepseekV3Config(
            **{**_COMMON, "num_hidden_layers": 3},
            intermediate_size=48,
            moe_intermediate_size=16,
            num_key_value_heads=4,
            num_experts=8,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
            output_router_logits=True,
        ),
        key=jax.random.key(0),
    ),
    "gpt_oss": lambda: GptOssForCausalLM.init(
        GptOssConfig(
            **_COMMON,
            intermediate_size=16,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            sliding_window=4,
            output_router_logits=True,
        ),
        key=jax.random.key(0),
    ),
    "qwen3_next": lambda: Qwen3NextForCausalLM.init(
        Qwen3NextConfig(
            **{**_COMMON, "num_hidden_layers": 4},
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            output_router_logits=True,
        ),
        key=jax.random.key(0),
    ),
}


def _ids():
    return jax.random.randint(jax.random.key(1), (8, 16), 0, 64)


def _loss_and_grads(model, mesh=None):
    loss = lambda m, ids: m.compute_loss(ids)[0]
    fn = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        return fn(model, _ids())
    with jax.set_mesh(mesh):
        return fn(shard(model, None, mesh), shard_batch(_ids(), mesh))


def _max_relative(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        if jnp.max(jnp.abs(y)) > 0
    )


@pytest.mark.parametrize(
    ("family", "dims"),
    [
        pytest.param("mixtral", (1, 2, 1, 1, 4), marks=pytest.mark.slow),
        pytest.param("mixtral", (2, 1, 2, 1, 2), marks=pytest.mark.slow),
        pytest.param("qwen3_moe", (1, 1, 2, 1, 4), marks=pytest.mark.slow),
        pytest.param("qwen3_moe", (1, 4, 1, 1, 2), marks=pytest.mark.slow),
        pytest.param("deepseek_v3", (1, 2, 1, 1, 4), marks=pytest.mark.slow),
        pytest.param("deepseek_v3", (2, 1, 2, 1, 2), marks=pytest.mark.slow),
        pytest.param("gpt_oss", (1, 1, 2, 1, 4), marks=pytest.mark.slow),
        pytest.param("qwen3_next", (1, 2, 1, 1, 4), marks=pytest.mark.slow),
    ],
)
def test_moe_families_with_experts_split_equal_one_device(family, dims):  # ~35-130 s each
    """Loss (with the router's auxiliary loss, over the global batch) and every gradient of
    a tiny model with its experts split over ``expert`` (and fsdp / tp / dp) equal the
    single-device run within float32 rounding; the expert weights really are split."""
    model = FAMILIES[family]()
    mesh = make_mesh(dims)
    ref_loss, ref_grads = _loss_and_grads(model)
    loss, grads = _loss_and_grads(model, mesh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-6)
    assert _max_relative(grads, ref_grads) <= 1e-4
    specs = partition_specs(model, None, mesh=mesh)
    expert_specs = [s for p, s in edl.tree.flatten(specs).items() if ".experts." in p]
    assert expert_specs and all(s[1] == "expert" for s in expert_specs)


@pytest.mark.slow  # ~45 s: three compiled SGD steps on one device and on a mesh
def test_jitted_train_step_with_experts_split_equals_one_device():
    model = FAMILIES["mixtral"]()
    tx = optax.sgd(0.5)

    def run(mesh):
        state = edl.create_state(model, tx)
        step = make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=False, mesh=mesh)
        losses = []
        for _ in range(3):
            state, metrics = step(state, {"ids": _ids()})
            losses.append(float(metrics["loss"]))
        return np.array(losses), state

    ref_losses, ref = run(None)
    losses, state = run(make_mesh((1, 2, 1, 1, 4)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_relative(state.params, ref.params) <= 1e-5
    gate = state.params.model.layers.mlp.experts.gate_proj  # (2, 8, 32, 32)
    assert gate.sharding.spec == P(None, "expert", "tp", "fsdp")  # tp of size 1 here
    assert gate.addressable_shards[0].data.shape == (2, 2, 32, 16)
