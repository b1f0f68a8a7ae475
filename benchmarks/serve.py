"""Serving throughput and latency: ``edl serve``'s app (``edl.serve``: continuous batching over
the paged KV cache) driven over loopback by the official ``openai`` client at several
concurrencies, against the same requests run one after another through ``edl.generate`` and
through transformers' ``generate``.

The model is a random-weight byte-level Llama (``--hidden``/``--layers``; the defaults,
hidden 768 and 16 layers, are ~104M parameters; ``--quick`` is a ~10M model and fewer
requests, a smoke run of a few minutes). Every request is a ``--prompt-len``-token prompt
(token ids, so the length is exact) and asks for exactly ``--max-tokens`` greedy tokens (no
EOS ids: nothing stops early). Per concurrency ``c``: ``2 c`` streamed requests from ``c``
client threads; output tokens/s (all completion tokens / wall time), time to first token and
inter-token latency (p50, p99, from the stream's chunk arrival times). The engine compiles
every step shape first (``Engine.warmup``, timed and reported), so compile time is not in
the serving numbers. Baselines: the same requests one after another through
``edl.generate`` (its default, and ``unstack_layers=True``, the form the engine runs) and
through transformers' ``generate``. The ``edl.generate`` baseline is timed before and after
the served runs and the faster of the two counts. ``EDL_NATIVE_KERNELS=0`` in the
environment runs the server without the native CPU paged attention (for an A/B).

``--structured N``: structured output's cost instead: the served throughput alone, on one
server, ``N`` rounds of plain requests then requests whose ``response_format`` is a JSON schema
(``STRUCTURED``: an object whose one string, 1000 characters at least, is longer than any
reply, so every request still makes exactly ``--max-tokens`` tokens, each masked by its
grammar: ``edl.serve.grammar``), and the medians' ratio. The engine then has a Hugging Face
tokenizer with the byte tokenizer's ids (``_byte_hf_tokenizer``), which llguidance needs.

    python -m benchmarks.serve [--quick] [--concurrency 1 4 16 64] [--prompt-len 100]
                               [--max-tokens 128] [--structured N] [--out results.json]

Prints a table, then LAST one JSON line with every number (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import byte_llama_config
from edl.generate import generate
from edl.models import LlamaForCausalLM
from edl.serve.engine import Engine
from edl.serve.server import create_app, make_server
from edl.train import ByteTokenizer


def _model(hidden: int, layers: int, max_len: int) -> LlamaForCausalLM:
    config = byte_llama_config(hidden, layers, max_len)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    # Only printable ASCII bytes win the argmax (the other rows of the head are zero, below
    # the best of 95 random logits): every token is text at once, so each streamed chunk is
    # one token (an incomplete UTF-8 sequence would be held back, skewing TTFT and
    # inter-token times; the first benchmark run measured that by mistake).
    head = model.lm_head.weight
    ids = np.arange(head.shape[0])
    keep = (ids >= 32) & (ids < 127)
    return eqx.tree_at(lambda m: m.lm_head.weight, model, jnp.where(keep[:, None], head, 0.0))


# --structured: a JSON object whose one string cannot end within a reply (exact lengths).
STRUCTURED = {
    "type": "json_schema",
    "json_schema": {
        "name": "bench",
        "schema": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 1000}},
            "required": ["text"],
        },
    },
}


def _byte_hf_tokenizer():
    """``edl.text.HFTokenizer`` with ``ByteTokenizer``'s ids (bytes 0-255, then pad, bos,
    eos): a byte-level BPE without merges, so llguidance can read its vocabulary."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from edl.text import HFTokenizer

    # GPT-2's byte-to-character table, which the ByteLevel pre-tokenizer and decoder use.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    chars = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    vocab = {c: b for b, c in chars.items()}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(["<pad>", "<s>", "</s>"])  # 256, 257, 258
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    assert fast.convert_tokens_to_ids(["<pad>", "</s>"]) == [256, 258]
    return HFTokenizer(fast, "bytes")


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, length).tolist() for _ in range(n)]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def _one_stream(
    client, prompt: list[int], max_tokens: int, first=None, structured: bool = False
) -> tuple[float, list[float], int]:
    """``(ttft, inter-token gaps, completion tokens)`` of one streamed completion;
    ``first()`` is called when its first token arrives; ``structured``: with
    ``STRUCTURED`` as its response_format."""
    start = time.perf_counter()
    arrivals, tokens = [], 0
    stream = client.completions.create(
        model="bench",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"response_format": STRUCTURED} if structured else None,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            if first is not None and len(arrivals) == 1:
                first()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft = arrivals[0] - start if arrivals else float("nan")
    return ttft, list(np.diff(arrivals)), tokens


def _ttft_while_decoding(
    client, args: argparse.Namespace, busy: int = 15, probes: int = 8
) -> dict[str, float]:
    """The issue's latency case: ``busy`` streams decoding (each past its first token),
    then ``probes`` new ``--prompt-len``-token requests one after another; their time to
    first token (p50, p99)."""
    decoding = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(busy) as pool:
        background = [
            pool.submit(_one_stream, client, p, args.max_tokens, decoding.release)
            for p in _prompts(busy, args.prompt_len, 1234)
        ]
        for _ in range(busy):
            decoding.acquire()
        ttfts = [_one_stream(client, p, 1)[0] for p in _prompts(probes, args.prompt_len, 4321)]
        still_decoding = sum(not f.done() for f in background)
        for f in background:
            f.result()
    return {**_percentiles(ttfts), "busy_streams_left_after_probes": still_decoding}


def _server_process(args: argparse.Namespace) -> None:
    """``--server``: the server, in its own process (the client threads' Python work does
    not share its GIL). Builds the model and engine, compiles every step shape, serves on a
    free loopback port, prints ``{"port", "warmup"}`` as one JSON line, and when a line
    arrives on stdin stops and prints ``{"free_pages_after"}``."""
    max_len = args.prompt_len + args.max_tokens
    model = _model(args.hidden, args.layers, max_len)
    tokenizer = _byte_hf_tokenizer() if args.structured else ByteTokenizer()
    engine = Engine(
        model,
        max_batch=max(args.concurrency),
        max_model_len=max_len,
        page_size=16,
        prefill_chunk=args.prefill_chunk,
        prefill_tokens=args.prefill_tokens,
        tokenizer=tokenizer if args.structured else None,
    )
    start = time.perf_counter()
    engine.warmup()
    warmup = {
        "shapes": len(engine.step_shapes()),
        "programs": len(engine.step_programs()),  # each shape with and without log-probs
        "seconds": time.perf_counter() - start,
    }
    app = create_app(engine, tokenizer, model_name="bench", max_model_len=max_len)
    server = make_server(app, port=0, log_level="warning")
    thread = threading.Thread(target=server.run)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(json.dumps({"port": port, "warmup": warmup}), flush=True)
    sys.stdin.readline()
    server.should_exit = True
    thread.join(60)
    print(
        json.dumps({"free_pages_after": engine.num_free_pages == engine.num_total_pages}),
        flush=True,
    )


def _throughput(client, args: argparse.Namespace, structured: bool) -> dict[str, dict]:
    """Per concurrency ``c``: ``2 c`` streamed requests from ``c`` client threads."""
    results = {}
    for c in args.concurrency:
        prompts = _prompts(2 * c, args.prompt_len, c)
        one = lambda p: _one_stream(client, p, args.max_tokens, None, structured)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as pool:
            runs = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        tokens = sum(n for _, _, n in runs)
        results[str(c)] = {
            "requests": len(runs),
            "output_tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "ttft_s": _percentiles([t for t, _, _ in runs]),
            "itl_s": _percentiles([g for _, gaps, _ in runs for g in gaps]),
        }
        print(
            f"  {c:>3} clients{' (structured)' if structured else ''}: {tokens / wall:8.1f} "
            f"tok/s, ttft p50 {results[str(c)]['ttft_s']['p50']:.3f} s, itl p50 "
            f"{results[str(c)]['itl_s']['p50'] * 1e3:.1f} ms",
            flush=True,
        )
    return results


def _served(args: argparse.Namespace) -> dict[str, dict]:
    """The served measurements; ``--structured N``: ``N`` rounds of plain then structured
    requests (``STRUCTURED``) on one server, as ``results["rounds"]``."""
    options = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("prompt_len", "max_tokens", "prefill_chunk", "prefill_tokens", "hidden", "layers")
    ]
    options += [f"--structured={args.structured}"]
    options += ["--concurrency", *map(str, args.concurrency)]
    command = [sys.executable, "-m", "benchmarks.serve", "--server", *options]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started = json.loads(process.stdout.readline())
    port, warmup = started["port"], started["warmup"]
    print(
        f"  warm-up: {warmup['programs']} step programs ({warmup['shapes']} shapes) compiled "
        f"in {warmup['seconds']:.0f} s",
        flush=True,
    )
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    results: dict = {"warmup": warmup}
    try:
        for structured in (False, True) if args.structured else (False,):  # the path, once
            _one_stream(client, _prompts(1, args.prompt_len, 99)[0], 4, None, structured)
        if args.structured:  # the side-by-side throughput only, alternating (this VM drifts)
            rounds = [
                (m, _throughput(client, args, m))
                for _ in range(args.structured)
                for m in (False, True)
            ]
            results["rounds"] = rounds
            return results
        results.update(_throughput(client, args, False))
        busy = min(15, max(args.concurrency) - 1)  # one batch place left for the probe
        ttft = _ttft_while_decoding(client, args, busy=busy)
        results["ttft_while_decoding_s"] = {"busy": busy, **ttft}
        print(
            f"  TTFT of a {args.prompt_len}-token prompt while {busy} requests decode: p50 "
            f"{ttft['p50']:.3f} s, p99 {ttft['p99']:.3f} s",
            flush=True,
        )
    finally:
        process.stdin.write("stop\n")
        process.stdin.flush()
        results.update(json.loads(process.stdout.readline()))
        process.wait(60)
    return results


def _sequential_edl(model, prompts: list[list[int]], max_tokens: int, unstack: bool) -> float:
    # The random model has no generation_config, so no EOS id: every run makes max_tokens.
    run = lambda p: generate(
        model, jnp.asarray([p]), max_new_tokens=max_tokens, unstack_layers=unstack
    )
    jax.block_until_ready(run(prompts[0]).sequences)  # compile
    start = time.perf_counter()
    for p in prompts:
        jax.block_until_ready(run(p).sequences)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def _sequential_torch(model, prompts: list[list[int]], max_tokens: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    hf = edl.to_torch(model).eval()
    with torch.no_grad():
        run = lambda p: hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
        run(prompts[0])
        start = time.perf_counter()
        for p in prompts:
            run(p)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~10M model, 1 / 4 clients")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64],
        help="concurrent clients per measurement (quick: 1 4)",
    )
    parser.add_argument("--prompt-len", type=int, default=100, help="prompt tokens per request")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request (quick: 32)"
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=128, help="the engine's prefill chunk (tokens)"
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=256, help="the engine's prefill tokens per step"
    )
    parser.add_argument(
        "--hidden", type=int, default=768, help="the served Llama's hidden size (quick: 384)"
    )
    parser.add_argument("--layers", type=int, default=16, help="its decoder layers (quick: 6)")
    parser.add_argument("--sequential", type=int, default=4, help="requests per baseline")
    parser.add_argument(
        "--structured",
        type=int,
        default=0,
        help="N: structured output's cost: N rounds of plain and JSON-schema requests",
    )
    parser.add_argument("--out", help="also write the JSON results to this file")
    parser.add_argument(
        "--server", action="store_true", help="internal: the server process this script starts"
    )
    return parser


def _structured_cost(args: argparse.Namespace) -> None:
    """``--structured N``: N rounds of plain then structured requests on one server, and per
    concurrency the medians' ratio of output tokens/s."""
    served = _served(args)
    results = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "runs": {}}
    for c in map(str, args.concurrency):
        plain = [r[c]["tokens_per_s"] for m, r in served["rounds"] if not m]
        constrained = [r[c]["tokens_per_s"] for m, r in served["rounds"] if m]
        ratio = float(np.median(constrained) / np.median(plain))
        results["runs"][c] = {"plain": plain, "structured": constrained, "ratio": ratio}
        print(
            f"  {c:>3} clients: plain {np.median(plain):.1f} tok/s, structured "
            f"{np.median(constrained):.1f} tok/s (medians of {len(plain)}): {ratio:.3f}x",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results))


def main() -> None:
    args = build_parser().parse_args()
    if args.server:
        return _server_process(args)
    if args.quick:
        args.hidden, args.layers, args.concurrency, args.max_tokens = 384, 6, [1, 4], 32
    if args.structured:
        return _structured_cost(args)
    model = _model(args.hidden, args.layers, args.prompt_len + args.max_tokens)
    params = edl.count_params(model)
    print(
        f"serve benchmark: {params:,} parameters, prompt {args.prompt_len}, "
        f"{args.max_tokens} new tokens, jax {jax.__version__} on {jax.devices()[0].platform}",
        flush=True,
    )
    prompts = _prompts(args.sequential, args.prompt_len, 7)
    # The baseline is timed before and after serving and the faster counts: this VM drifts
    # by up to ~25% over the minutes between them, and the ratio should not gain from a slow
    # spell of the baseline.
    edl_seq_before = _sequential_edl(model, prompts, args.max_tokens, unstack=False)
    served = _served(args)
    edl_seq_after = _sequential_edl(model, prompts, args.max_tokens, unstack=False)
    edl_seq = max(edl_seq_before, edl_seq_after)
    edl_unstacked = _sequential_edl(model, prompts, args.max_tokens, unstack=True)
    torch_seq = _sequential_torch(model, prompts, args.max_tokens)
    print(
        f"  sequential edl.generate: {edl_seq:.1f} tok/s (before serving {edl_seq_before:.1f}, "
        f"after {edl_seq_after:.1f}; unstack_layers=True: "
        f"{edl_unstacked:.1f}); transformers generate: "
        f"{torch_seq if torch_seq is None else round(torch_seq, 1)} tok/s",
        flush=True,
    )
    ratios = {c: served[c]["tokens_per_s"] / edl_seq for c in served if c.isdigit()}
    print(
        "  served / sequential edl.generate: "
        + ", ".join(f"{c} clients {r:.2f}x" for c, r in ratios.items()),
        flush=True,
    )
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "platform": jax.devices()[0].platform,
        "parameters": params,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "served": served,
        "sequential_edl_tokens_per_s": edl_seq,
        "sequential_edl_before_after": [edl_seq_before, edl_seq_after],
        "sequential_edl_unstacked_tokens_per_s": edl_unstacked,
        "sequential_transformers_tokens_per_s": torch_seq,
        "served_over_sequential_edl": ratios,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
