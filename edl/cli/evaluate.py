"""``edl eval``: lm-evaluation-harness tasks on a saved model, checkpoint, run or hub model."""

from __future__ import annotations

import argparse
import sys

from edl.cli.config import CommandError

__all__ = ["run_eval"]


def run_eval(args: argparse.Namespace) -> None:
    """Evaluate ``args.model`` on ``args.tasks`` (``edl eval``'s checked options): lm-eval's
    table on stdout, the results JSON at ``args.output`` (atomically)."""
    try:
        from lm_eval.utils import make_table

        from edl.eval.lm import EdlLM
        from edl.eval.run import evaluate, task_manager, write_results
    except ImportError as e:
        raise CommandError(f"edl eval needs lm-eval: pip install 'edl-jax[eval]' ({e})") from None
    lm = EdlLM(args.model, batch_size=args.batch_size, max_length=args.max_length, dtype=args.dtype)
    manager = task_manager(args.include_path, args.tasks)
    try:
        results = evaluate(
            lm, args.tasks, manager=manager, limit=args.limit, num_fewshot=args.num_fewshot
        )
    except ValueError as e:  # an unknown task, a generation setting edl lacks, ...
        raise CommandError(str(e)) from None
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.output is not None:
        write_results(args.output, results)
        print(f"edl eval: results written to {args.output}", file=sys.stderr)
