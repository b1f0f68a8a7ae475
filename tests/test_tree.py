"""edl.tree: flatten/unflatten, named traversals, validation, load_into, named_sharding."""

import logging
import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from edl import tree


class Pair(eqx.Module):
    """A Module with two dynamic fields and a static one, for structural tests."""

    a: object
    b: object
    tag: str = eqx.field(static=True, default="pair")


# ---------------------------------------------------------------- random pytrees

_leaf_arrays = st.builds(
    lambda shape, dtype: np.zeros(shape, dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([np.float32, np.int32, np.bool_, jnp.bfloat16]),
)
_leaves = st.one_of(_leaf_arrays, st.integers(-5, 5), st.floats(allow_nan=False), st.none())
_keys = st.text("abcdefgh_0123", min_size=1, max_size=4)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(_keys, children, max_size=3),
        st.builds(Pair, children, children),
    )


random_trees = st.recursive(_leaves, _containers, max_leaves=12)


@given(random_trees)
def test_flatten_unflatten_round_trip_is_exact(t):
    flat = tree.flatten(t)
    leaves = jax.tree.leaves(t)
    assert list(flat.values()) == leaves or all(
        a is b for a, b in zip(flat.values(), leaves, strict=True)
    )
    back = tree.unflatten(flat, t)
    assert jax.tree.structure(back) == jax.tree.structure(t)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), leaves, strict=True))
    assert tree.paths(t) == list(flat)


@given(
    st.dictionaries(
        _keys,
        st.recursive(
            _leaf_arrays, lambda c: st.dictionaries(_keys, c, min_size=1, max_size=3), max_leaves=8
        ),
        max_size=4,
    )
)
def test_unflatten_without_like_nests_dicts(t):
    nested = tree.unflatten(tree.flatten(t))
    # Empty dicts have no leaves, so compare through flatten.
    assert tree.flatten(nested).keys() == tree.flatten(t).keys()
    assert all(
        a is b for a, b in zip(tree.flatten(nested).values(), tree.flatten(t).values(), strict=True)
    )


def test_flatten_paths_of_module_list_dict_and_optax_state():
    mlp = eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(0))
    assert list(tree.flatten(mlp))[:4] == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    opt = optax.adam(1e-3).init({"w": jnp.zeros(2), "frozen": None})
    assert set(tree.flatten(opt)) == {"0.count", "0.mu.w", "0.nu.w"}
    assert tree.flatten({"a": [1, (2, None), {}], "b": None}, sep="/") == {"a/0": 1, "a/1/0": 2}


def test_path_str_renders_every_key_kind():
    kp = (
        jax.tree_util.GetAttrKey("layers"),
        jax.tree_util.SequenceKey(3),
        jax.tree_util.DictKey("attn"),
        jax.tree_util.FlattenedIndexKey(1),
    )
    assert tree.path_str(kp) == "layers.3.attn.1"
    assert tree.path_str(kp, sep="/") == "layers/3/attn/1"
    assert tree.path_str((tree.PathKey(kp[:2]), jax.tree_util.DictKey(7)), "/") == "layers/3/7"
    assert tree.path_str(()) == ""


def test_flatten_rejects_colliding_paths():
    with pytest.raises(ValueError, match=r"'a\.b'"):
        tree.flatten({"a.b": 1, "a": {"b": 2}})
    assert tree.flatten({"a.b": 1, "a": {"b": 2}}, sep="/") == {"a.b": 1, "a/b": 2}


def test_unflatten_names_missing_and_unexpected_paths():
    like = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
    with pytest.raises(ValueError, match=r"1 missing paths:\n  b") as e:
        tree.unflatten({"w": 1, "extra.x": 2}, like)
    assert "unexpected paths:\n  extra.x" in str(e.value)
    with pytest.raises(ValueError, match="both a leaf and a prefix"):
        tree.unflatten({"a": 1, "a.b": 2})


def test_named_map_passes_paths_and_rest_trees():
    t = {"x": jnp.ones(2), "y": [jnp.zeros(1)]}
    out = tree.named_map(lambda p, a, b: (p, a.shape, b), t, {"x": 1, "y": [2]})
    assert out == {"x": ("x", (2,), 1), "y": [("y.0", (1,), 2)]}
    seen = tree.named_map(lambda p, _: p, {"a": {"b": 0}}, sep="::")
    assert seen == {"a": {"b": "a::b"}}


def test_tree_apply_applies_by_path_and_rejects_unknown_paths():
    t = Pair(jnp.ones(2), [jnp.ones(3)])
    out = tree.tree_apply({"b.0": lambda x: x * 2}, t)
    np.testing.assert_array_equal(out.b[0], 2 * np.ones(3))
    assert out.a is t.a and out.tag == "pair"
    with pytest.raises(ValueError, match=r"paths are not leaves of the tree:\n  b\.1\n  c"):
        tree.tree_apply({"b.1": abs, "c": abs}, t)


def test_is_flat():
    assert tree.is_flat({})
    assert tree.is_flat({"a.b": jnp.ones(2), "c": 3})
    assert not tree.is_flat({"a": {"b": 1}})
    assert not tree.is_flat({"a": [1]})
    assert not tree.is_flat({1: jnp.ones(1)})
    assert not tree.is_flat([jnp.ones(1)])
    assert not tree.is_flat({"a": None})


def test_validate_reports_every_kind_of_difference():
    like = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "n": jnp.zeros(1, jnp.int32), "f": abs}
    got = {"w": np.zeros((3, 2), np.float32), "n": np.zeros(1, np.float32), "x": 1, "f": max}
    r = tree.validate(got, like)
    assert not r.ok
    assert r.missing == ("b",)
    assert r.unexpected == ("x",)
    assert r.shape_mismatches == (("w", (2, 3), (3, 2)),)
    assert r.dtype_mismatches == (("n", np.dtype("int32"), np.dtype("float32")),)
    assert tree.validate(got, like, check_dtype=False).dtype_mismatches == ()
    with pytest.raises(ValueError, match=r"w: \(2, 3\) vs \(3, 2\)") as e:
        r.raise_if_invalid("checkpoint")
    assert str(e.value).startswith("checkpoint does not match")
    ok = tree.validate(
        like,
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
            like,
        ),
    )
    assert ok.ok and ok.message() == "trees match"


def _model(seed=0):
    return eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(seed))


def test_load_into_strict_round_trips_and_casts():
    src = _model(1)
    dst = _model(2)
    flat = {
        p: np.asarray(x, np.float64) for p, x in tree.flatten(src).items() if tree.is_array_like(x)
    }
    out = tree.load_into(dst, flat)
    for p, x in tree.flatten(out).items():
        if tree.is_array_like(x):
            assert x.dtype == jnp.float32, p
            np.testing.assert_array_equal(x, tree.flatten(src)[p])
    assert out.activation is dst.activation


def test_load_into_strict_error_names_every_bad_key():
    dst = _model()
    flat = {p: x for p, x in tree.flatten(_model()).items() if tree.is_array_like(x)}
    del flat["layers.0.bias"], flat["layers.1.weight"]
    flat["layers.0.weight"] = np.zeros((9, 9), np.float32)
    flat["layers.2.weight"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="load_into: the flat dict does not match") as e:
        tree.load_into(dst, flat)
    msg = str(e.value)
    for key in (
        "layers.0.bias",
        "layers.1.weight",
        "layers.2.weight",
        "layers.0.weight: (4, 3) vs (9, 9)",
    ):
        assert key in msg
    with pytest.raises(ValueError, match=r"layers\.1\.bias: float32 vs int32"):
        tree.load_into(
            dst,
            {**tree.flatten(eqx.filter(dst, eqx.is_array)), "layers.1.bias": np.zeros(2, np.int32)},
            cast=False,
        )


def test_load_into_non_strict_keeps_missing_ignores_unexpected_and_logs(caplog):
    dst = _model()
    new_w = np.full((4, 3), 7.0, np.float32)
    with caplog.at_level(logging.WARNING, logger="edl"):
        out = tree.load_into(dst, {"layers.0.weight": new_w, "junk": np.ones(1)}, strict=False)
    np.testing.assert_array_equal(out.layers[0].weight, new_w)
    assert out.layers[1].weight is dst.layers[1].weight
    assert "junk" in caplog.text and "layers.1.weight" in caplog.text
    with pytest.raises(ValueError, match=r"layers\.0\.weight: \(4, 3\) vs \(1,\)"):
        tree.load_into(dst, {"layers.0.weight": np.ones(1, np.float32)}, strict=False)


def test_load_into_abstract_model_and_sharding():
    abstract = eqx.filter_eval_shape(_model)
    src = _model(3)
    flat = tree.flatten(eqx.filter(src, eqx.is_array))
    loaded = tree.load_into(abstract, flat)
    assert isinstance(loaded.layers[0].weight, jax.Array)
    with pytest.raises(ValueError, match=r"missing paths:\n  layers\.0\.bias"):
        tree.load_into(
            abstract, {k: v for k, v in flat.items() if k != "layers.0.bias"}, strict=False
        )

    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    target = {"w": jax.ShapeDtypeStruct((16, 2), jnp.float32, sharding=sharding)}
    out = tree.load_into(target, {"w": np.arange(32, dtype=np.float32).reshape(16, 2)})
    assert out["w"].sharding == sharding
    assert {s.data.shape for s in out["w"].addressable_shards} == {(2, 2)}


def test_named_sharding_maps_specs_and_names_bad_paths():
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    specs = {"w": P("dp", "tp"), "b": None, "layers": [P(), P(None, "tp")]}
    out = tree.named_sharding(specs, mesh)
    assert out["b"] is None
    assert out["w"] == NamedSharding(mesh, P("dp", "tp"))
    assert out["layers"][1].spec == P(None, "tp")
    with pytest.raises(ValueError, match=r"'layers\.0'"):
        tree.named_sharding({"layers": [P("nope")]}, mesh)
    with pytest.raises(TypeError, match=r"'w\.0' holds str, not a PartitionSpec"):
        tree.named_sharding({"w": ("dp",)}, mesh)


def test_structure_difference_names_paths():
    a = {"x": jnp.ones(1), "y": None}
    b = {"x": None, "y": jnp.ones(1)}
    assert tree.structure_difference(a, b, none_is_leaf=True) is None
    assert (
        tree.structure_difference(a, b, names=("g", "p")) == "path 'x' is in the g but not in the p"
    )
    assert "'y' is in the second" in tree.structure_difference({"x": 1}, {"x": 1, "y": 2})
    assert (
        tree.structure_difference(Pair(1, 2), (1, 2))
        == "path 'a' is in the first but not in the second"
    )
    same_paths = tree.structure_difference(Pair(1, 2), Pair(1, 2, tag="other"))
    assert same_paths.startswith("same paths, different node types:\n  first: ")


def test_compile_pattern_error_names_pattern():
    assert tree.compile_pattern(re.compile("a")).pattern == "a"
    with pytest.raises(ValueError, match=r"invalid path regex '\('"):
        tree.compile_pattern("(")
