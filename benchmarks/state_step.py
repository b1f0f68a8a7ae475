"""Per-step time of a jitted train step: edl.TrainState vs eqx.filter_jit vs raw arrays.

TrainState flattens to its arrays with a custom pytree node, so every call pays that flatten
(and an unflatten of the result). This measures what that costs against the two usual ways
of writing the same step, on MLPs from dispatch-bound (few small arrays) to many-leaf.

    python -m benchmarks.state_step [--quick]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import edl
from benchmarks._common import table, time_call, write_json

CONFIGS = {  # name: (width, depth)
    "tiny (6 arrays)": (32, 2),
    "deep (98 arrays)": (64, 48),
    "wide (26 arrays)": (512, 12),
}


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _edl_step(model, tx):
    state = edl.create_state(model, tx)

    @jax.jit(donate_argnums=0)
    def step(state, x, y):
        loss, grads = edl.value_and_grad(_loss)(state, x, y)
        return edl.apply_gradients(state, grads, tx), loss

    return state, step


def _eqx_step(model, tx):
    carry = (model, tx.init(eqx.filter(model, eqx.is_inexact_array)))

    @eqx.filter_jit(donate="all")
    def step(carry, x, y):
        model, opt_state = carry
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return (eqx.apply_updates(model, updates), opt_state), loss

    return carry, step


def _raw_step(model, tx):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    carry = (leaves, tx.init(leaves))

    @jax.jit(donate_argnums=0)
    def step(carry, x, y):
        leaves, opt_state = carry

        def loss(leaves):
            return _loss(eqx.combine(jax.tree.unflatten(treedef, leaves), static), x, y)

        value, grads = jax.value_and_grad(loss)(leaves)
        updates, opt_state = tx.update(grads, opt_state, leaves)
        return (optax.apply_updates(leaves, updates), opt_state), value

    return carry, step


VARIANTS = {
    "edl TrainState + jax.jit": _edl_step,
    "eqx.filter_jit": _eqx_step,
    "raw leaves + jax.jit": _raw_step,
}


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with jax.numpy_dtype_promotion("standard"):
        run(args.quick)


def run(quick: bool) -> None:
    tx = optax.adamw(1e-3)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jnp.zeros((64, 1))
    rows = []
    for name, (width, depth) in CONFIGS.items():
        times = {}
        for variant, build in VARIANTS.items():
            # A fresh model per variant: each step donates (and so deletes) its inputs.
            carry, step = build(eqx.nn.MLP(16, 1, width, depth, key=jax.random.key(1)), tx)
            box = [carry]

            def call(step=step, box=box):
                box[0], loss = step(box[0], x, y)
                return loss

            times[variant] = time_call(call, repeats=3 if quick else 7, number=5 if quick else 50)
        base = times["raw leaves + jax.jit"]
        for variant, t in times.items():
            rows.append(
                {"model": name, "variant": variant, "us_per_step": t * 1e6, "vs_raw": t / base}
            )
    print(table(["model", "variant", "us/step", "x raw"], [list(r.values()) for r in rows]))
    print("wrote", write_json("state_step", rows, quick=quick))


if __name__ == "__main__":
    main()
