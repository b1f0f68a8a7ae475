"""The ``edl`` command: ``edl train``, ``edl generate``, ``edl info``.

``edl train`` with no arguments trains a small Llama on the embedded corpus (the Python
standard library's own sources, byte-level) for a few minutes on a CPU, then prints a
sample. Every option is a flag, or a key of a TOML file given with ``--config`` (flags win).
Parsing and checking the options imports no jax, so ``--help`` and mistakes answer at once;
errors are one line on stderr and exit status 2 (1 for a run that fails).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from edl.cli.config import FIELDS, CommandError, ConfigError, TrainConfig, flag, read_toml

__all__ = ["TrainConfig", "main"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``edl train: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_TYPES = {"int": int, "float": float, "str": str}
_METAVARS = {"int": "N", "float": "X", "str": "TEXT"}


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="TOML",
        help="TOML file of options (keys as the flags, with _ for -); flags win",
    )  # fmt: skip
    for name, field in FIELDS.items():
        meta = field.metadata
        shown = meta["help"] + f" (default: {field.default})"
        if field.type == "bool":
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None,
                                help=shown)  # fmt: skip
            continue
        metavar = None if meta["choices"] else _METAVARS[field.type]
        parser.add_argument(flag(name), type=_TYPES[field.type], default=None,
                            choices=meta["choices"], help=shown, metavar=metavar)  # fmt: skip


def _train_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = read_toml(args.config) if args.config is not None else {}
    values.update({k: v for k, v in vars(args).items() if k in FIELDS and v is not None})
    return TrainConfig(**values)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edl", description="edl's command line: train, generate, info.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser(
        "train", help="train a model (defaults: a tiny Llama on the embedded corpus)",
        description="Train a Llama byte-level model; see the README for what each file holds.",
    )  # fmt: skip
    _add_train_flags(train)
    gen = commands.add_parser("generate", help="sample from a saved model or a run directory")
    gen.add_argument("--model", type=Path, required=True,
                     help="a run directory, a checkpoint or a saved model")  # fmt: skip
    gen.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    gen.add_argument("--max-new-tokens", type=int, default=200,
                     help="bytes to generate (default: 200)")  # fmt: skip
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: 0.0)")  # fmt: skip
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    info = commands.add_parser("info", help="summarise a saved model, checkpoint or run")
    info.add_argument("path", type=Path, help="a run directory, checkpoint or saved model")
    return parser


def _check_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        parser.error(f"argument --max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        parser.error(f"argument --temperature: must be >= 0, got {args.temperature}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``edl`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            config = _train_config(args)
        elif args.command == "generate":
            _check_generate(parser, args)
    except ConfigError as e:
        parser.exit(2, f"edl {args.command}: error: {e}\n")
    try:  # the commands import jax: only after every option was checked
        _run(args, config if args.command == "train" else None)
    except CommandError as e:
        parser.exit(1, f"edl {args.command}: error: {e}\n")


def _run(args: argparse.Namespace, config: TrainConfig | None) -> None:
    if config is not None:
        from edl.cli.train import run_train

        run_train(config)
    elif args.command == "generate":
        from edl.cli.generate import run_generate

        run_generate(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, seed=args.seed)  # fmt: skip
    else:
        from edl.cli.info import run_info

        run_info(args.path)
