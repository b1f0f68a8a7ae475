"""EasyDeL's side of ``benchmarks/model.py``: its Llama forward and AdamW train step, timed
in EasyDeL's own environment (it pins its own jax), printed as one JSON line.

Not imported by edl: ``benchmarks/model.py --easydel-python PATH`` runs this file with that
interpreter (a venv made by ``pip install easydel==0.3.0 pillow torch==2.13.0``). The train
step is the idiomatic functional one for a flax-nnx model: split the module, differentiate
the causal-LM loss (full-vocabulary logits, ``optax.softmax_cross_entropy_with_integer_labels``
on the shifted labels) with respect to the parameters, ``optax.adamw``, donated state;
EasyDeL's forward needs its mesh as context.

    python benchmarks/easydel_llama.py --layers 4 --batch 4 --seq 256 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _seconds(fn, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` (which blocks on its outputs) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=688, help="MLP intermediate size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    import easydel as ed
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    config = ed.LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    model = ed.LlamaForCausalLM(
        config=config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, config.vocab_size)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-4)

    def loss_fn(params, ids):
        logits = nnx.merge(graphdef, params, rest)(input_ids=ids).logits
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), ids[:, 1:]
        ).mean()

    @jax.jit
    def forward(params, ids):
        return nnx.merge(graphdef, params, rest)(input_ids=ids).logits

    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    reps = {"warmup": args.warmup, "repeats": args.repeats}
    with model.mesh:
        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), ids)
        compiled = compiled.compile()
        compile_s = time.perf_counter() - start
        forward_s = _seconds(lambda: jax.block_until_ready(forward(params, ids)), **reps)
        box = [params, tx.init(params)]

        def train():
            box[0], box[1], loss = compiled(box[0], box[1], ids)
            jax.block_until_ready(loss)

        train_s = _seconds(train, **reps)
    print(
        json.dumps(
            {
                "forward_s": forward_s,
                "train_step_s": train_s,
                "compile_s": compile_s,
                "easydel": ed.__version__,
                "jax": jax.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
