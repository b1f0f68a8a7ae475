"""The training loop's standard callbacks, one per concern (see ``edl.train.core``).

``edl.train.train`` composes them from its options; a hand-built loop can pick its own and
pass them to ``edl.train.core.run_loop``, with the user's own ``Callback`` subclasses or
``edl.train.callback(fn, every=n)``.
"""

from edl.train.callbacks.checkpoint import Checkpoint
from edl.train.callbacks.evaluation import Evaluate, evaluate
from edl.train.callbacks.loss_plot import LossPlot, loss_curve_png
from edl.train.callbacks.metrics_log import METRICS_FILE, MetricsLog, logged
from edl.train.callbacks.nonfinite import NonFiniteLossError, NonFinitePolicy, is_nonfinite
from edl.train.callbacks.param_norm import ParamNorm
from edl.train.callbacks.progress import ProgressBar, console
from edl.train.callbacks.run_report import RunReport, summarize, write_run_summary
from edl.train.callbacks.signals import StopOnSignal
from edl.train.callbacks.tensorboard import TensorBoardLog, tensorboard_available
from edl.train.callbacks.throughput import Throughput
from edl.train.callbacks.time_limit import TimeLimit

__all__ = [
    "METRICS_FILE",
    "Checkpoint",
    "Evaluate",
    "LossPlot",
    "MetricsLog",
    "NonFiniteLossError",
    "NonFinitePolicy",
    "ParamNorm",
    "ProgressBar",
    "RunReport",
    "StopOnSignal",
    "TensorBoardLog",
    "Throughput",
    "TimeLimit",
    "console",
    "evaluate",
    "is_nonfinite",
    "logged",
    "loss_curve_png",
    "summarize",
    "tensorboard_available",
    "write_run_summary",
]
