"""``ParamNorm``: the global norm of the trainable parameters."""

from __future__ import annotations

from edl.train.core import Callback, StepInfo
from edl.train.step import global_norm

__all__ = ["ParamNorm"]


class ParamNorm(Callback):
    """``param_norm``, the float32 global norm of ``state.params``, every ``every`` steps."""

    def __init__(self, *, every: int) -> None:
        self.every = every

    def metrics(self, info: StepInfo) -> dict[str, float]:
        return {"param_norm": float(global_norm(info.state.params))}
