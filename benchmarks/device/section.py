"""Run one section of the device run in this process, reporting to a result file.

    python -m benchmarks.device.section NAME --result FILE --out DIR [--dry-run] [--budget S]

The driver (``benchmarks.device.run``) starts one such process per section, so a section
that crashes, runs out of memory or overruns its time (killed) costs only itself, and each
starts with the whole accelerator. A section function is called as ``fn(sink, dry=...,
deadline=common.Deadline, out=...)``; it skips (and notes in ``meta["skipped"]``) the
measurements its deadline leaves no time for. The result file holds ``{"meta", "rows"}``
(``common.Sink``); an exception is recorded in ``meta["error"]`` and the exit code is 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.device.common import Deadline, Sink, short_error

# name -> "module:function"; the order is the run's order.
SECTIONS = {
    "environment": "benchmarks.device.env:run_environment",
    "tests": "benchmarks.device.env:run_tests",
    "attention": "benchmarks.device.kernels:run_attention",
    "train": "benchmarks.device.models:run_train",
    "decode": "benchmarks.device.models:run_decode",
    "serve": "benchmarks.device.models:run_serve",
}


def section_function(name: str) -> Callable[..., None]:
    """The function that runs section ``name`` (``SECTIONS``)."""
    module, function = SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), function)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=list(SECTIONS), help="the section to run")
    parser.add_argument("--result", type=Path, required=True, help="the section's JSON file")
    parser.add_argument("--out", type=Path, required=True, help="the run's output folder")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds this section has")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the section into its sink; 0 on success, 1 on an error."""
    args = build_parser().parse_args(argv)
    deadline = Deadline(args.budget)
    sink = Sink(args.result)
    sink.write()
    try:
        section_function(args.name)(sink, dry=args.dry_run, deadline=deadline, out=args.out)
    except Exception as err:
        sink.set(error=short_error(err), traceback=traceback.format_exc()[-3000:])
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
