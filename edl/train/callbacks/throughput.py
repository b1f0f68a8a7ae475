"""``Throughput``: tokens per second, model FLOPs utilisation and device memory."""

from __future__ import annotations

import jax

from edl.train.core import Callback, RunStart, StepInfo

__all__ = ["Throughput"]


def _device_memory() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


class Throughput(Callback):
    """Every ``every`` steps: ``tokens_per_s`` over the steps since the last report (the
    steps' own time: compile, evaluation and saving excluded), ``mfu`` =
    ``tokens_per_s * flops_per_token / peak_flops`` when both are given, and
    ``memory_bytes`` where the device reports it. Counts the step's ``tokens`` metric (the
    tokens the model ran over: both sequences of a preference pair, a GRPO batch's prompts
    and completions times its updates), else its ``count`` (the target tokens of the
    language-model losses); the last step's stands for each step of the interval. A
    ``sampled_tokens`` metric (GRPO's completions) gives ``sampled_tokens_per_s`` too."""

    def __init__(
        self,
        *,
        every: int = 1,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.every, self.flops_per_token, self.peak_flops = every, flops_per_token, peak_flops
        self._since: tuple[int, float] = (0, 0.0)

    def on_start(self, run: RunStart) -> None:
        self._since = (run.start_step, 0.0)

    def metrics(self, info: StepInfo) -> dict[str, float | int]:
        (step, seconds), self._since = self._since, (info.step, info.train_seconds)
        count = info.metrics.get("tokens", info.metrics.get("count"))
        spent, steps = info.train_seconds - seconds, info.step - step
        out: dict[str, float | int] = {}
        if count is not None and spent > 0:
            rate = count * steps / spent
            out["tokens_per_s"] = rate
            if self.flops_per_token and self.peak_flops:
                out["mfu"] = rate * self.flops_per_token / self.peak_flops
            if "sampled_tokens" in info.metrics:
                out["sampled_tokens_per_s"] = info.metrics["sampled_tokens"] * steps / spent
        memory = _device_memory()
        if memory is not None:
            out["memory_bytes"] = memory
        return out
