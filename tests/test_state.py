"""edl.state: TrainState as a frozen pytree and the pure functions that update it."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import edl
from edl import state as st
from edl import tree

TRAINABLE = r"layers\.1\.bias|layers\.2\."  # 3 of the MLP's 6 arrays; the others are frozen


def _mlp(seed=0, width=16):
    return eqx.nn.MLP(4, 1, width, 2, key=jax.random.key(seed))


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _data(n=64, seed=1):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, 4))
    y = jnp.sin(x @ jax.random.normal(kw, (4, 1)))
    return x, y


def test_create_splits_and_initialises_only_trainables():
    model = _mlp()
    bare = st.create(model)
    assert bare.step.dtype == jnp.int32 and bare.step.shape == ()
    assert bare.opt_state is None
    s = st.create(model, optax.adam(1e-3), trainable=lambda x: x.ndim == 2, step=7)
    assert int(s.step) == 7
    assert set(tree.flatten(s.params)) == {"layers.0.weight", "layers.1.weight", "layers.2.weight"}
    mu = tree.flatten(s.opt_state[0].mu)
    assert set(mu) == set(tree.flatten(s.params))
    assert st.model(s).layers[0].bias is model.layers[0].bias
    with pytest.raises(ValueError, match=r"integer scalar, got shape \(2,\)"):
        st.replace(bare, step=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"integer scalar, got shape \(\) dtype float32"):
        st.replace(bare, step=jnp.float32(1))


def test_apply_gradients_matches_float64_adamw_reference():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    tx = optax.adamw(lr, b1, b2, eps, weight_decay=wd)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 5)), "b": rng.normal(size=(5,))}
    s = st.create(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params), tx)
    ref = {k: np.asarray(v, np.float64) for k, v in tree.flatten(s.params).items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(v) for k, v in ref.items()}
    for t in range(1, 5):
        grads = {k: rng.normal(size=p.shape).astype(np.float32) for k, p in params.items()}
        s = st.apply_gradients(s, jax.tree.map(jnp.asarray, grads), tx)
        for k in ref:
            g = grads[k].astype(np.float64)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            mhat, vhat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            ref[k] = ref[k] - lr * (mhat / (np.sqrt(vhat) + eps) + wd * ref[k])
        assert int(s.step) == t
        for k in ref:
            # float32 state vs float64 reference: a few ulps per step.
            np.testing.assert_allclose(s.params[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_apply_gradients_errors_name_the_path():
    tx = optax.sgd(0.1)
    s = st.create(_mlp(), trainable=TRAINABLE)  # no optimizer yet
    zeros = jax.tree.map(jnp.zeros_like, s.params)
    with pytest.raises(ValueError, match=r"no optimizer state.*init_tx"):
        st.apply_gradients(s, zeros, tx)
    s = st.init_tx(s, tx)
    model_grads = jax.tree.map(jnp.zeros_like, eqx.filter(st.model(s), eqx.is_inexact_array))
    with pytest.raises(
        ValueError, match=r"'layers\.0\.weight' is in the grads but not in the params"
    ):
        st.apply_gradients(s, model_grads, tx)
    missing = eqx.tree_at(lambda p: p.layers[2].bias, zeros, replace=None)
    with pytest.raises(
        ValueError, match=r"path 'layers\.2\.bias' is in the params but not in the grads"
    ):
        st.apply_gradients(s, missing, tx)
    wrong = eqx.tree_at(lambda p: p.layers[2].bias, zeros, replace=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"'layers\.2\.bias' has shape \(3,\), params \(1,\)"):
        st.apply_gradients(s, wrong, tx)


def test_apply_gradients_passes_frozen_arrays_through_untouched():
    tx = optax.sgd(0.1)
    s = st.create(_mlp(), tx, trainable=TRAINABLE)
    s2 = st.apply_gradients(s, jax.tree.map(jnp.ones_like, s.params), tx)
    assert s2.other.layers[0].weight is s.other.layers[0].weight
    assert s2.other.activation is jax.nn.relu
    np.testing.assert_allclose(s2.params.layers[2].bias, s.params.layers[2].bias - 0.1)


def test_state_is_frozen_and_replace_checks_fields():
    s = st.create(_mlp())
    with pytest.raises(AttributeError, match="frozen"):
        s.step = 3
    s2 = st.replace(s, step=5)
    assert s2.step.dtype == jnp.int32 and int(s2.step) == 5 and int(s.step) == 0
    assert s2.params.layers[0].weight is s.params.layers[0].weight
    with pytest.raises(TypeError, match=r"no field\(s\) \['stepp'\]"):
        st.replace(s, stepp=1)
    assert st.replace(s, opt_state={"x": jnp.ones(3)}).opt_state["x"].shape == (3,)


def test_size_counts_every_array_of_the_state():
    s = st.create(_mlp(), optax.adam(1e-3), trainable=TRAINABLE)
    n_params = edl.count_params(s.params)
    expected = 4 + 4 * (n_params * 2 + edl.count_params(s.other) + n_params) + 4  # + adam count
    assert st.size(s) == expected == edl.nbytes(s)


def test_state_pytree_holds_only_arrays_keyed_by_path():
    s = st.create(_mlp(), optax.adam(1e-3), trainable=TRAINABLE)
    paths = tree.flatten(s)
    assert list(paths)[:4] == [
        "step",
        "params.layers.1.bias",
        "params.layers.2.weight",
        "params.layers.2.bias",
    ]
    assert "other.layers.0.weight" in paths and "opt_state.0.mu.layers.2.weight" in paths
    assert all(isinstance(x, jax.Array) for x in paths.values())
    assert s.other.activation is jax.nn.relu  # non-array leaves survive as static metadata
    back = tree.unflatten(paths, s)
    assert st.model(back).layers[0].weight is s.other.layers[0].weight
    shapes = jax.eval_shape(lambda s: s, s)
    assert shapes.params.layers[2].weight == jax.ShapeDtypeStruct((1, 16), jnp.float32)
    assert "TrainState(step=Array(0, dtype=int32), params=<3 arrays" in repr(s)


def test_unhashable_non_array_leaf_is_a_clear_error():
    with pytest.raises(TypeError, match=r"other\.table holds an unhashable set"):
        st.TrainState(jnp.int32(0), params={}, other={"table": {1, 2}})


def _train_step(tx, loss_fn):
    def step(s, x, y):
        loss, grads = st.value_and_grad(loss_fn)(s, x, y)
        return st.apply_gradients(s, grads, tx), loss

    return step


def test_jit_with_donation_consumes_the_old_state():
    tx = optax.adam(1e-2)
    s = st.create(_mlp(), tx, trainable=TRAINABLE)
    old_leaves = jax.tree.leaves(s)
    step = jax.jit(_train_step(tx, _mse), donate_argnums=0)
    s, _ = step(s, *_data())
    assert int(s.step) == 1
    assert all(x.is_deleted() for x in old_leaves)


def test_filter_jit_with_donation_and_value_and_grad_aux():
    tx = optax.sgd(0.1)
    s = st.create(_mlp(), tx)

    def loss_with_aux(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2), {"mean_pred": jnp.mean(pred)}

    @eqx.filter_jit(donate="all")
    def step(s, x, y):
        (loss, aux), grads = st.value_and_grad(loss_with_aux, has_aux=True)(s, x, y)
        return st.apply_gradients(s, grads, tx), loss, aux

    s, loss, aux = step(s, *_data())
    assert int(s.step) == 1 and loss.shape == () and aux["mean_pred"].shape == ()


def test_sharded_state_through_jit_out_shardings():
    mesh = jax.make_mesh((8,), ("fsdp",))
    tx = optax.adam(1e-2)
    s = st.create(eqx.nn.MLP(4, 1, 16, 2, key=jax.random.key(0)), tx, trainable=TRAINABLE)

    def spec(x):
        return P("fsdp") if x.ndim >= 1 and x.shape[0] % 8 == 0 else P()

    shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), s)
    s = jax.device_put(s, shardings)
    assert {sh.data.shape for sh in s.params.layers[1].bias.addressable_shards} == {(2,)}
    step = jax.jit(_train_step(tx, _mse), donate_argnums=0, out_shardings=(shardings, None))
    s, _ = step(s, *_data())
    assert s.opt_state[0].mu.layers[1].bias.sharding == shardings.params.layers[1].bias


def test_mlp_trains_with_half_its_arrays_frozen():
    """50 jitted steps: loss falls; frozen arrays are bit-identical and have no optimizer state."""
    model = _mlp()
    tx = optax.adam(1e-2)
    s = st.create(model, tx, trainable=TRAINABLE)
    frozen_before = {
        p: np.array(x) for p, x in tree.flatten(s.other).items() if tree.is_array_like(x)
    }
    assert set(frozen_before) == {"layers.0.weight", "layers.0.bias", "layers.1.weight"}
    assert len(tree.flatten(s.params)) == 3  # half of the 6 arrays train

    step = jax.jit(_train_step(tx, _mse), donate_argnums=0)
    x, y = _data()
    losses = []
    for _ in range(50):
        s, loss = step(s, x, y)
        losses.append(float(loss))

    assert int(s.step) == 50
    assert losses[-1] < 0.5 * losses[0], losses
    for p, before in frozen_before.items():
        np.testing.assert_array_equal(tree.flatten(s.other)[p], before, err_msg=p)
    opt_paths = set(tree.flatten(s.opt_state))
    assert not any(frozen in p for p in opt_paths for frozen in frozen_before), opt_paths
    assert {p.removeprefix("0.mu.") for p in opt_paths if p.startswith("0.mu.")} == set(
        tree.flatten(s.params)
    )
    trained = st.model(s)
    assert float(_mse(trained, x, y)) == pytest.approx(
        float(jax.jit(functools.partial(_mse, trained))(x, y)), rel=1e-6
    )
