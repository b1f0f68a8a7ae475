"""lm-evaluation-harness in process (the ``eval`` extra: ``pip install 'edl-jax[eval]'``).

``edl.eval.lm.EdlLM`` is lm-eval's model ``"edl"`` (registered when this package is
imported); ``edl.eval.scoring`` its compiled teacher-forced scoring; ``edl.eval.run``
runs tasks on it (``edl eval``); ``edl.eval.callback.LMEval`` runs them during ``train()``.
``python -m edl.eval`` is lm-eval's own command line with ``"edl"`` registered.
"""

from edl.eval.callback import LMEval
from edl.eval.lm import EdlLM
from edl.eval.run import evaluate, task_manager, task_metrics, write_results

__all__ = ["EdlLM", "LMEval", "evaluate", "task_manager", "task_metrics", "write_results"]
