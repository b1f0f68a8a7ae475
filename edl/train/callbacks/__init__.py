"""The training loop's standard callbacks, one per concern (see ``edl.train.core``).

``edl.train.train`` composes them from its options; a hand-built loop can pick its own and
pass them to ``edl.train.core.run_loop``, with the user's own ``Callback`` subclasses or
``edl.train.callback(fn, every=n)``.
"""

from edl.train.callbacks.checkpoint import Checkpoint
from edl.train.callbacks.evaluation import Evaluate, evaluate
from edl.train.callbacks.loss_plot import LossPlot
from edl.train.callbacks.metrics_log import MetricsLog
from edl.train.callbacks.nonfinite import NonFiniteLossError, NonFinitePolicy
from edl.train.callbacks.param_norm import ParamNorm
from edl.train.callbacks.profile import Profile
from edl.train.callbacks.progress import ProgressBar
from edl.train.callbacks.run_report import RunReport
from edl.train.callbacks.signals import StopOnSignal
from edl.train.callbacks.tensorboard import TensorBoardLog
from edl.train.callbacks.throughput import Throughput
from edl.train.callbacks.time_limit import TimeLimit
from edl.train.callbacks.wandb_log import WandbLog

__all__ = [
    "Checkpoint",
    "Evaluate",
    "LossPlot",
    "MetricsLog",
    "NonFiniteLossError",
    "NonFinitePolicy",
    "ParamNorm",
    "Profile",
    "ProgressBar",
    "RunReport",
    "StopOnSignal",
    "TensorBoardLog",
    "Throughput",
    "TimeLimit",
    "WandbLog",
    "evaluate",
]
