"""edl.module: split/merge, trainable filters, dtype casts, counts, abstract init, summary."""

import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import edl
from edl import tree


class Block(eqx.Module):
    """Floating, integer and non-array leaves side by side, plus a static field."""

    attn: eqx.nn.Linear
    lora_a: jax.Array
    lora_b: jax.Array
    positions: jax.Array
    scale: float
    act: object
    name: str = eqx.field(static=True)

    @classmethod
    def init(cls, key: jax.Array, dim: int = 4) -> "Block":
        k1, k2 = jax.random.split(key)
        return cls(
            attn=eqx.nn.Linear(dim, dim, key=k1),
            lora_a=jax.random.normal(k2, (2, dim)),
            lora_b=jnp.zeros((dim, 2)),
            positions=jnp.arange(dim),
            scale=0.5,
            act=jax.nn.gelu,
            name="block",
        )


@pytest.fixture
def block():
    return Block.init(jax.random.key(0))


def _trainable_paths(params):
    return set(tree.flatten(params))


def test_split_default_takes_all_inexact_arrays_without_copies(block):
    params, other = edl.split(block)
    assert _trainable_paths(params) == {"attn.weight", "attn.bias", "lora_a", "lora_b"}
    assert set(tree.flatten(other)) == {"positions", "scale", "act"}
    assert params.attn.weight is block.attn.weight  # shared, not copied
    assert other.positions is block.positions
    assert params.positions is None and other.attn.weight is None
    assert params.name == other.name == "block"


def test_split_by_regex_predicate_and_bool_tree(block):
    by_regex = edl.split(block, r"lora_")[0]
    assert _trainable_paths(by_regex) == {"lora_a", "lora_b"}
    by_compiled = edl.split(block, re.compile(r"^attn\."))[0]
    assert _trainable_paths(by_compiled) == {"attn.weight", "attn.bias"}
    # A regex can't make an integer array trainable.
    assert _trainable_paths(edl.split(block, "positions|lora_a")[0]) == {"lora_a"}

    by_pred = edl.split(block, lambda x: x.ndim == 2)[0]
    assert _trainable_paths(by_pred) == {"attn.weight", "lora_a", "lora_b"}

    # A predicate of (path, leaf): freeze by path without a lookahead regex.
    by_path = edl.split(block, lambda path, leaf: not path.startswith("attn.") and leaf.ndim == 2)
    assert _trainable_paths(by_path[0]) == {"lora_a", "lora_b"}
    seen = []
    edl.split(block, lambda path, leaf, scale=1.0: seen.append(path) or False)  # a default: 2
    assert "attn.weight" in seen

    mask = Block(
        attn=True, lora_a=False, lora_b=True, positions=True, scale=True, act=True, name="block"
    )
    assert _trainable_paths(edl.split(block, mask)[0]) == {"attn.weight", "attn.bias", "lora_b"}
    assert _trainable_paths(edl.split(block, False)[0]) == set()


def test_trainable_predicates_of_other_arity_are_refused(block):
    with pytest.raises(TypeError, match=r"must take \(leaf\) or \(path, leaf\)"):
        edl.split(block, lambda path, leaf, depth: True)


def test_help_of_split_and_create_state_shows_the_trainable_forms():
    for fn in (edl.split, edl.create_state, edl.summary):
        assert "lambda path, leaf" in fn.__doc__ and "a pytree of Python bools" in fn.__doc__


def test_trainable_mask_errors_name_the_problem(block):
    with pytest.raises(TypeError, match=r"leaf 'lora_a' is int"):
        edl.split(block, Block(True, 1, True, True, True, True, name="block"))
    with pytest.raises(ValueError, match="not a prefix of the model"):
        edl.split(block, {"attn": True})
    with pytest.raises(ValueError, match=r"invalid path regex '\['"):
        edl.split(block, "[")


@given(st.integers(0, 2**31 - 1), st.sampled_from([None, r"lora", r"weight$", r"^$"]))
def test_merge_is_exact_inverse_of_split(seed, trainable):
    model = Block.init(jax.random.key(seed))
    merged = edl.merge(*edl.split(model, trainable))
    assert jax.tree.structure(merged) == jax.tree.structure(model)
    assert all(a is b for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(model), strict=True))


def test_merge_errors_name_paths(block):
    params, _ = edl.split(block)
    with pytest.raises(ValueError, match=r"both hold a value at 'attn\.weight' \(4 such paths\)"):
        edl.merge(params, block)
    with pytest.raises(ValueError, match=r"path 'x' is in the params but not in the other"):
        edl.merge({"x": 1, "y": None}, {"y": 2})


def test_to_dtype_casts_floating_leaves_only(block):
    half = edl.module.to_half(block)
    assert half.attn.weight.dtype == jnp.float16
    assert half.positions.dtype == jnp.int32 and half.positions is block.positions
    assert half.scale == 0.5 and half.act is jax.nn.gelu
    assert edl.module.to_bfloat16(block).lora_a.dtype == jnp.bfloat16
    back = edl.module.to_float(half)
    assert back.attn.weight.dtype == jnp.float32
    np.testing.assert_allclose(back.attn.weight, block.attn.weight, rtol=2**-10)
    same = edl.to_dtype(block, jnp.float32)
    assert same.attn.weight is block.attn.weight  # no-op cast copies nothing
    sds = edl.to_dtype({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, jnp.bfloat16)
    assert sds["w"] == jax.ShapeDtypeStruct((2,), jnp.bfloat16)
    assert edl.to_dtype({"c": jnp.ones(2, jnp.complex64)}, jnp.float16)["c"].dtype == jnp.complex64


def test_count_params_and_nbytes(block):
    # attn 4x4 + 4, lora 2x4 + 4x2, positions 4 (int32); scale/act are not arrays
    assert edl.count_params(block) == 16 + 4 + 8 + 8 + 4
    assert edl.count_params(edl.split(block)[0]) == 36
    assert edl.nbytes(block) == 4 * 40
    assert edl.nbytes(edl.module.to_bfloat16(block)) == 2 * 36 + 4 * 4
    assert edl.nbytes({"q": jnp.zeros((3, 5), jnp.int4), "m": jnp.zeros(3, jnp.bool_)}) == 8 + 3
    assert edl.nbytes({"s": jax.ShapeDtypeStruct((10, 10), jnp.float16)}) == 200


def test_abstract_allocates_nothing_and_matches_real_init():
    abstract = edl.abstract(Block.init, jax.random.key(0), dim=8)
    real = Block.init(jax.random.key(0), dim=8)
    assert all(
        isinstance(x, jax.ShapeDtypeStruct)
        for x in tree.flatten(abstract).values()
        if tree.is_array_like(x)
    )
    assert tree.validate(real, abstract).ok
    assert abstract.act is jax.nn.gelu
    # Abstract models split like real ones (shardings are planned on them).
    assert _trainable_paths(edl.split(abstract, "lora")[0]) == {"lora_a", "lora_b"}


def test_summary_lists_arrays_with_totals(block):
    text = edl.summary(block, "lora")
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "params", "trainable"]
    row = next(line for line in lines if line.startswith("lora_b"))
    assert row.split() == ["lora_b", "(4,", "2)", "float32", "8", "yes"]
    assert next(line for line in lines if line.startswith("attn.weight")).split()[-1] == "16"
    assert lines[-1] == "total: 40 params (40), trainable: 16 (16), 160B"
    assert "act" not in {line.split()[0] for line in lines}
    short = edl.summary(block, max_rows=2).splitlines()
    assert "... 3 more rows ..." in short
    # Trainable rows first, so a short table shows what trains; or only those.
    first = [line.split()[0] for line in edl.summary(block, "lora").splitlines()[2:4]]
    assert first == ["lora_a", "lora_b"]
    only = edl.summary(block, "lora_b", trainable_only=True).splitlines()
    assert [line.split()[0] for line in only[2:-2]] == ["lora_b"]
    assert only[-1] == "total: 40 params (40), trainable: 8 (8), 160B"
    big = {"w": jax.ShapeDtypeStruct((1000, 2500), jnp.bfloat16)}
    assert edl.summary(big).splitlines()[-1] == (
        "total: 2,500,000 params (2.50M), trainable: 2,500,000 (2.50M), 5.00MB"
    )
