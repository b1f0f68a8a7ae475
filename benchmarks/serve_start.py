"""How long ``edl serve`` takes to start, with jax's persistent compilation cache cold and warm.

A random byte-level Llama (``--hidden`` / ``--layers``; defaults: hidden 256, 8 layers, about
6M parameters) is saved to a temporary directory; ``edl serve --model DIR`` then starts
``--starts`` times in a row (the first with an empty compilation cache, a fresh
``JAX_COMPILATION_CACHE_DIR``, the others with what the earlier starts left there), each
in its own process. Per start: seconds until ``/health`` answers, until one completion
(``--max-tokens`` greedy tokens) is answered, and until ``--concurrent`` concurrent
completions (different prompt lengths, so several step shapes) are all answered. With
``--warmup`` the server compiles every step shape before it listens. ``--no-cache`` runs
every start with ``EDL_COMPILE_CACHE=0`` (the cache off).

    python -m benchmarks.serve_start [--warmup] [--starts 2] [--hidden 256] [--layers 8]
                                     [--concurrent 8] [--max-tokens 16] [--no-cache]

Prints one line per start, then LAST one JSON line with every number.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks._common import byte_llama_config

_TIMEOUT_S = 900.0


def _save_model(directory: Path, hidden: int, layers: int) -> None:
    import jax

    import edl
    from edl.models import LlamaForCausalLM

    config = byte_llama_config(hidden, layers, 1024)
    edl.save_pretrained(LlamaForCausalLM.init(config, key=jax.random.key(0)), directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as reply:
        return json.loads(reply.read())


def _wait_health(base: str, process: subprocess.Popen, begin: float) -> float:
    while time.perf_counter() - begin < _TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"edl serve exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return time.perf_counter() - begin
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    raise TimeoutError(f"edl serve did not answer /health within {_TIMEOUT_S} s")


def _one_start(args: argparse.Namespace, model: Path, cache: Path) -> dict[str, float]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    if args.no_cache:
        env["EDL_COMPILE_CACHE"] = "0"
        env.pop("JAX_COMPILATION_CACHE_DIR")
    command = ["edl", "serve", "--model", str(model), "--port", str(port), "--max-batch", "16"]
    begin = time.perf_counter()
    process = subprocess.Popen(
        [*command, *(["--warmup"] if args.warmup else [])],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        health = _wait_health(base, process, begin)
        body = {"model": str(model), "prompt": "def ", "max_tokens": args.max_tokens}
        _post(f"{base}/v1/completions", body)
        first = time.perf_counter() - begin
        prompts = ["x" * (8 + 23 * i) for i in range(args.concurrent)]  # several widths
        with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
            list(
                pool.map(lambda p: _post(f"{base}/v1/completions", {**body, "prompt": p}), prompts)
            )
        burst = time.perf_counter() - begin
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {"health_s": health, "first_reply_s": first, "burst_done_s": burst}


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", action="store_true", help="start with edl serve --warmup")
    parser.add_argument("--starts", type=int, default=2, help="starts in a row (default: 2)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    parser.add_argument("--layers", type=int, default=8, help="layers (default: 8)")
    parser.add_argument(
        "--concurrent", type=int, default=8, help="concurrent requests after the first (8)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (16)")
    parser.add_argument("--no-cache", action="store_true", help="every start with the cache off")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, cache = Path(tmp) / "model", Path(tmp) / "jax-cache"
        _save_model(model, args.hidden, args.layers)
        starts = []
        for i in range(args.starts):
            got = _one_start(args, model, cache)
            files = len(list(cache.glob("*-cache"))) if cache.exists() else 0
            starts.append({**got, "cache_files_after": files})
            print(
                f"start {i + 1}: /health {got['health_s']:.1f} s, first reply "
                f"{got['first_reply_s']:.1f} s, {args.concurrent} concurrent done "
                f"{got['burst_done_s']:.1f} s; {files} cache files",
                flush=True,
            )
    print(json.dumps({"args": vars(args), "starts": starts}))


if __name__ == "__main__":
    sys.exit(main())
