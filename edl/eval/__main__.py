"""``python -m edl.eval``: lm-eval's own command line with the ``edl`` model registered.

lm-eval 0.4.13 discovers models only from its own table (``lm_eval.models.MODEL_MAPPING``),
not from entry points, so ``lm_eval --model edl`` cannot find an out-of-tree model. This
module imports ``edl.eval.lm`` (which registers ``"edl"``) and hands the arguments to
lm-eval's ``cli_evaluate``::

    python -m edl.eval --model edl --model_args pretrained=DIR,batch_size=8 \\
        --tasks hellaswag --include_path my_tasks/
"""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import edl.eval.lm  # noqa: F401  (registers the "edl" model)

if __name__ == "__main__":
    cli_evaluate()
