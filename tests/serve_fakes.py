"""A fake ``edl.serve.types.Engine`` for the server's tests (tests/test_serve_api.py), and,
run as a script, the server over it (``python tests/serve_fakes.py --port N``), which prints
the engine's record as JSON when the app's lifespan has ended: the SIGTERM test reads it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence

from edl.serve.types import Logprob, QueueFull, RequestOutput, SamplingParams
from edl.text import ByteTokenizer

MODEL = "fake-model"
EOS = ByteTokenizer.eos_id


def reply_of(prompt_ids: Sequence[int], seed: int | None = None) -> str:
    """The fake model's whole reply to a prompt (multi-byte characters on purpose); a
    seeded request's reply names its seed (the n / best_of tests tell choices apart)."""
    said = "" if seed is None else f"[seed {seed}] "
    return f"{said}You sent {len(prompt_ids)} tokens. Ça va → très bien, merci! Bye."


def seed_logprob(seed: int | None) -> float:
    """Each token's sampled log-prob in the fake engine (what best_of ranks by): seeds 0 mod
    3 are the likeliest."""
    return -1.0 - (0 if seed is None else seed % 3)


def fake_logprob(token: int, k: int) -> Logprob:
    """The fake model's log-prob of ``token`` (-1 - token / 1000) and its ``k`` alternatives
    (ids ``token + 1 + i``, log-probs -2 - i)."""
    return Logprob(
        token, -1 - token / 1000, tuple(((token + 1 + i) % 256, -2.0 - i) for i in range(k))
    )


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a toy chat template."""

    chat_template = "<role>content\\n ... <assistant>"

    def apply_chat_template(self, messages, *, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class FakeEngine:
    """``edl.serve.types.Engine`` over ``reply_of``: one token per running request per step
    (then EOS; ``tokens_per_step`` > 1: that many in one output, as a speculative engine's
    verified runs), ``max_running`` requests at most (``QueueFull`` beyond), ``step_delay``
    seconds per step. Records aborts, the largest batch, every calling thread and the
    params of every request added; ``reply`` replaces ``reply_of``."""

    def __init__(
        self,
        *,
        max_running: int = 64,
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        reply: Callable[..., str] = reply_of,
        tokens_per_step: int = 1,
    ) -> None:
        self.max_running, self.step_delay = max_running, step_delay
        self.tokens_per_step = tokens_per_step
        self.fail_at_step, self.steps = fail_at_step, 0
        self.running: dict[int, tuple[list[int], SamplingParams, list[int]]] = {}
        self.ids = itertools.count()
        self.aborted: list[int] = []
        self.finished: list[int] = []
        self.threads: set[int] = set()
        self.largest_batch = 0
        self.prompts: dict[int, list[int]] = {}
        self.reply = reply
        self.params: list[SamplingParams] = []  # every request's, in order

    def _called(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        self._called()
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(self.running) >= self.max_running:
            raise QueueFull(f"{len(self.running)} requests running")
        request_id = next(self.ids)
        tokens = [*ByteTokenizer().encode(self.reply(prompt_ids, params.seed)), EOS]
        if params.max_tokens == 0:
            tokens = list(prompt_ids)
        self.prompts[request_id] = list(prompt_ids)
        self.params.append(params)
        self.running[request_id] = (tokens, params, [])
        return request_id

    def abort(self, request_id: int) -> None:
        self._called()
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        self._called()
        time.sleep(self.step_delay)
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("the fake engine's device fell over")
        self.largest_batch = max(self.largest_batch, len(self.running))
        outputs = []
        for request_id, (tokens, params, done) in list(self.running.items()):
            if params.max_tokens == 0:  # echo only: the prompt's log-probs, no token
                del self.running[request_id]
                prompt = (None, *(fake_logprob(t, params.prompt_logprobs) for t in tokens[1:]))
                outputs.append(RequestOutput(request_id, (), True, "length", None, prompt))
                continue
            new: list[int] = []
            reason = None
            while reason is None and len(new) < self.tokens_per_step:
                token = tokens[len(done)]
                done.append(token)
                new.append(token)
                reason = (
                    "stop"
                    if token in params.stop_token_ids
                    else "length"
                    if len(done) == params.max_tokens
                    else None
                )
            if reason is not None:
                del self.running[request_id]
                self.finished.append(request_id)
            logprobs = None if params.logprobs is None else (fake_logprob(token, params.logprobs),)
            prompt = None
            if params.prompt_logprobs is not None and len(done) == 1:
                ids = self.prompts[request_id][1:]
                prompt = (None, *(fake_logprob(t, params.prompt_logprobs) for t in ids))
            cumulative = len(done) * seed_logprob(params.seed)
            outputs.append(
                RequestOutput(
                    request_id, tuple(new), reason is not None, reason, logprobs, prompt, cumulative
                )
            )
        return outputs

    def has_unfinished(self) -> bool:
        self._called()
        return bool(self.running)

    @property
    def num_free_pages(self) -> int:
        return 100 - len(self.running)

    @property
    def num_total_pages(self) -> int:
        return 100

    @property
    def num_waiting(self) -> int:
        return 0  # every request runs at once (QueueFull past max_running)


def main() -> None:
    from edl.serve.options import ServerOptions
    from edl.serve.server import create_app, serve

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--drain-s", type=float, default=1.0)
    parser.add_argument("--options", type=json.loads, default={}, help="ServerOptions, as JSON")
    args = parser.parse_args()
    engine = FakeEngine(step_delay=args.step_delay)
    app = create_app(
        engine,
        ChatBytes(),
        model_name=MODEL,
        max_model_len=256,
        stop_token_ids=[EOS],
        options=ServerOptions(**args.options),
    )
    driver = app.state.server.driver
    stop = driver.stop

    async def stop_and_report() -> None:  # uvicorn re-raises SIGTERM after the lifespan ends
        await stop()
        alive = driver._thread.is_alive()
        record = {
            "aborted": engine.aborted,
            "finished": engine.finished,
            "running": list(engine.running),
            "engine_thread_alive": alive,
        }
        print(json.dumps(record), flush=True)

    driver.stop = stop_and_report
    serve(app, port=args.port, drain_s=args.drain_s, log_level="warning")


if __name__ == "__main__":
    main()
