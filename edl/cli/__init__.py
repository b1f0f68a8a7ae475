"""The ``edl`` command: ``edl train``, ``edl generate``, ``edl export``, ``edl info``,
``edl serve``, ``edl eval``.

``edl train`` with no arguments trains a small Llama on the embedded corpus (the Python
standard library's own sources, byte-level) for a few minutes on a CPU, then prints a
sample. Every option is a flag, or a key of a TOML file given with ``--config`` (flags win).
Parsing and checking the options imports no jax, so ``--help`` and mistakes answer at once;
errors are one line on stderr and exit status 2 (1 for a run that fails). ``edl train``
checks the rest (``--mesh`` against the devices, paths, the data's first record, the output
directory, ``--reward``) right after jax starts, before any model loads
(``edl.cli.checks``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from edl._kv_cache import KVCacheOptions
from edl._settings import Leaf, from_options, leaves
from edl._speculative import SpeculativeConfig
from edl.cli.config import (
    FIELDS,
    CommandError,
    ConfigError,
    TrainConfig,
    default_of,
    flag,
    read_toml,
)
from edl.serve.options import API_KEY_ENV, ServerOptions

__all__ = ["TrainConfig", "entry", "main"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``edl train: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="TOML",
        help="TOML file of options (keys as the flags, with _ for -); flags win",
    )
    _add_option_flags(parser, FIELDS, default_of)


def _add_option_flags(
    parser: argparse.ArgumentParser, fields: dict[str, Leaf], default: Callable[[Leaf], object]
) -> None:
    """A flag per option of ``fields`` (``edl._settings.leaves`` of a settings class), its
    help and shown default from the declaration; every flag's own default is None (unset)."""
    for name, leaf in fields.items():
        shown = f"{leaf.spec.help} (default: {leaf.shown(default(leaf))})"
        if leaf.scalar is bool:
            parser.add_argument(
                flag(name), action=argparse.BooleanOptionalAction, default=None, help=shown
            )
            continue
        kind = leaf.scalar if leaf.spec.parse is None else str  # text parsed by the option
        parser.add_argument(
            flag(name),
            type=kind,
            default=None,
            choices=leaf.spec.choices,
            help=shown,
            metavar=None if leaf.spec.choices else _METAVARS[kind],
        )


def _train_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, object] = read_toml(args.config) if args.config is not None else {}
    values.update({k: v for k, v in vars(args).items() if k in FIELDS and v is not None})
    return TrainConfig.from_options(values)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edl",
        description="edl's command line: train, generate, export, info, serve, eval.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser(
        "train",
        help="train a model (defaults: a tiny Llama on the embedded corpus)",
        description="Train a Llama byte-level model; see the README for what each file holds.",
    )
    _add_train_flags(train)
    _add_generate(commands)
    export = commands.add_parser(
        "export",
        help="write a checkpoint or run as a plain Hugging Face model directory",
        description="Write the model of a checkpoint (a run directory: its newest) to OUT_DIR "
        "as transformers loads it: weights, config.json, generation_config.json, tokenizer "
        "files. LoRA adapters are merged (--merge-lora) or written in PEFT's layout beside "
        "the base (transformers applies them, with peft); a quantized base is dequantized. "
        "OUT_DIR must be new, empty or an earlier export (which is replaced).",
    )
    export.add_argument(
        "source",
        type=Path,
        metavar="CHECKPOINT_OR_RUN_DIR",
        help="a run directory, a checkpoint or a saved model",
    )
    export.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the directory to write")
    export.add_argument(
        "--merge-lora",
        action="store_true",
        help="merge LoRA into the weights (else: a PEFT adapter beside the base)",
    )
    export.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="cast floating weights (default: as stored)"
    )
    _add_serve(commands)
    _add_eval(commands)
    info = commands.add_parser("info", help="summarise a saved model, checkpoint or run")
    info.add_argument("path", type=Path, help="a run directory, checkpoint or saved model")
    return parser


_DTYPES = ("bfloat16", "float32")


def _add_generate(commands: Any) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text with a saved model, checkpoint, run or hub model",
        description="Continue a prompt (or answer it as a chat turn, --chat) and stream the "
        "text to stdout. Greedy unless --temperature > 0. The tokenizer is the model "
        "directory's (tokenizer files), else the byte tokenizer of edl train's demo.",
    )
    gen.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_REPO",
        help="a run directory, checkpoint, saved model or hub repo id",
    )
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt", default=None, metavar="TEXT", help="text to continue (default: 'def ')"
    )
    prompt.add_argument(
        "--prompt-file",
        type=Path,
        default=None,
        metavar="F",
        help="read the prompt from this UTF-8 file",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message via the chat template",
    )
    gen.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message before the prompt (with --chat)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        metavar="N",
        help="tokens to generate at most (default: 200)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: 0.0)",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: the top tokens of mass P (0 < P <= 1)",
    )
    gen.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens"
    )
    gen.add_argument(
        "--num-beams",
        type=int,
        default=1,
        metavar="B",
        help="beam search with B beams, printed at the end (default: 1)",
    )
    gen.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="compute in this dtype (default: as stored)"
    )
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    _add_option_flags(gen, leaves(KVCacheOptions), lambda leaf: leaf.field.default)


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model at /v1/chat/completions, /v1/completions, /v1/models and "
        "/health (OpenAI's API, streaming included) with continuous batching. Needs the "
        "serve extra (pip install 'edl-jax[serve]'). SIGTERM / Ctrl-C stop it gracefully.",
    )
    serve.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_REPO",
        help="a run directory, checkpoint, saved model or hub repo id",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: --model as given)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument(
        "--max-batch",
        type=int,
        default=32,
        metavar="N",
        help="requests decoded together at most (default: 32)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="L",
        help="prompt + reply tokens at most (default: the model's max_position_embeddings)",
    )
    serve.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="compute in this dtype (default: as stored)"
    )
    serve.add_argument(
        "--warmup",
        action="store_true",
        help="compile every step shape before listening (seconds per shape "
        "for a deep model; otherwise each compiles on first use)",
    )
    _add_option_flags(serve, leaves(ServerOptions), lambda leaf: leaf.field.default)
    # Speculative decoding: off unless --speculative-method is given.
    _add_option_flags(serve, leaves(SpeculativeConfig), _speculation_default)
    _add_option_flags(serve, leaves(KVCacheOptions), lambda leaf: leaf.field.default)
    serve.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR_OR_REPO",
        help="the draft model of --speculative-method draft: a smaller model with the same "
        "tokenizer (a run directory, checkpoint, saved model or hub repo id)",
    )


def _add_eval(commands: Any) -> None:
    ev = commands.add_parser(
        "eval",
        help="score a model on lm-evaluation-harness tasks",
        description="Run lm-evaluation-harness tasks on a model in this process (lm-eval's "
        "model 'edl': batched, compiled log-likelihoods and generation), print lm-eval's "
        "table and write the results as JSON. Needs the eval extra (pip install "
        "'edl-jax[eval]'). Scores equal lm-eval's own hf backend on the same model.",
    )
    ev.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_REPO",
        help="a run directory, checkpoint, saved model or hub repo id (with tokenizer files)",
    )
    ev.add_argument(
        "--tasks", required=True, metavar="T1,T2", help="comma-separated lm-eval task names"
    )
    ev.add_argument(
        "--include-path",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="a directory of task YAMLs besides lm-eval's own (repeatable)",
    )
    ev.add_argument(
        "--limit", type=float, default=None, metavar="N", help="documents per task at most"
    )
    ev.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples per prompt"
    )
    ev.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="rows per batch (default: 8)"
    )
    ev.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="L",
        help="tokens the model sees at most (default: the model's max_position_embeddings)",
    )
    ev.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="compute in this dtype (default: as stored)"
    )
    ev.add_argument(
        "--output", type=Path, default=None, metavar="FILE", help="write the results JSON here"
    )


def _check_eval(args: argparse.Namespace) -> None:
    """``edl eval``'s options, checked before jax or lm-eval is imported."""
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        raise ConfigError("argument --tasks: no task names given")
    if args.batch_size < 1:
        raise ConfigError(f"argument --batch-size: must be >= 1, got {args.batch_size}")
    if args.limit is not None:
        if not args.limit > 0:
            raise ConfigError(f"argument --limit: must be > 0, got {args.limit}")
        args.limit = int(args.limit) if args.limit >= 1 else args.limit  # a count or a fraction
    if args.max_length is not None and args.max_length < 2:
        raise ConfigError(f"argument --max-length: must be >= 2, got {args.max_length}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"argument --num-fewshot: must be >= 0, got {args.num_fewshot}")
    for path in args.include_path or ():
        if not path.is_dir():
            raise ConfigError(f"argument --include-path: {path} is not a directory")
    if args.output is not None and not args.output.parent.is_dir():
        raise ConfigError(f"argument --output: {args.output.parent} is not a directory")


def _check_serve(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"argument --port: must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise ConfigError(f"argument --max-batch: must be >= 1, got {args.max_batch}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"argument --max-model-len: must be >= 2, got {args.max_model_len}")
    args.options = _server_options(args)
    args.speculative = _speculation(args)
    args.kv_cache = _kv_cache(args)
    method = None if args.speculative is None else args.speculative.method
    if (method == "draft") != (args.draft_model is not None):
        raise ConfigError(
            "argument --draft-model: needed by --speculative-method draft, and only by it"
        )


def _speculation_default(leaf: Leaf) -> object:
    return "off" if leaf.name == "speculative_method" else leaf.field.default


def _speculation(args: argparse.Namespace) -> SpeculativeConfig | None:
    """``SpeculativeConfig`` from ``edl serve``'s flags, or None without
    ``--speculative-method`` (its other flags alone are refused)."""
    names = leaves(SpeculativeConfig)
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if "speculative_method" not in values:
        if values:
            given = ", ".join(flag(k) for k in values)
            raise ConfigError(f"argument {given}: needs --speculative-method (ngram or draft)")
        return None
    return from_options(SpeculativeConfig, values, where="argument ")


def _kv_cache(args: argparse.Namespace) -> KVCacheOptions:
    """``KVCacheOptions`` from ``--kv-cache-dtype`` (checked against the registry)."""
    names = leaves(KVCacheOptions)
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return from_options(KVCacheOptions, values, where="argument ")


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """``ServerOptions`` from the flags; the API key from ``$EDL_API_KEY`` when the flag is
    not given (an empty variable is refused: a key meant to be there is missing)."""
    values = {k: v for k, v in vars(args).items() if k in leaves(ServerOptions) and v is not None}
    if "api_key" not in values and API_KEY_ENV in os.environ:
        values["api_key"] = os.environ[API_KEY_ENV]
        if not values["api_key"].strip():
            raise ConfigError(f"{API_KEY_ENV} is set but empty: unset it, or set the key")
    if not values.get("api_key", "x").strip():
        raise ConfigError("argument --api-key: must not be empty")
    return from_options(ServerOptions, values, where="argument ")


def _compile_cache() -> None:
    """jax's persistent compilation cache on (``edl.compile_cache``; ``EDL_COMPILE_CACHE=0``
    keeps it off): a restart with the same shapes loads its programs instead of compiling."""
    from edl.compile_cache import enable_compile_cache

    try:
        enable_compile_cache()
    except ValueError as e:  # a bad EDL_COMPILE_CACHE value
        raise ConfigError(str(e)) from None
    except OSError as e:  # the directory cannot be made
        raise CommandError(str(e)) from None


def _usage(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A usage error of ``edl generate`` (checked after parsing), as argparse's own."""
    parser.exit(2, f"edl generate: error: {message} (see edl generate --help)\n")


def _check_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every ``edl generate`` option checked, and ``--prompt-file`` read into
    ``args.prompt``, before anything imports jax."""
    if args.max_new_tokens < 1:
        _usage(parser, f"argument --max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        _usage(parser, f"argument --temperature: must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        _usage(parser, f"argument --top-p: must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        _usage(parser, f"argument --top-k: must be >= 1, got {args.top_k}")
    if args.num_beams < 1:
        _usage(parser, f"argument --num-beams: must be >= 1, got {args.num_beams}")
    try:
        args.kv_cache = _kv_cache(args)
    except ConfigError as e:
        _usage(parser, str(e))
    if args.kv_cache.kv_cache_dtype != "auto" and args.num_beams > 1:
        _usage(parser, "argument --kv-cache-dtype: a quantized cache is paged: no --num-beams")
    for name in ("top_p", "top_k"):
        if getattr(args, name) is not None and args.temperature == 0:
            _usage(
                parser,
                f"argument --{name.replace('_', '-')}: only applies when sampling "
                "(--temperature > 0)",
            )
    if args.system is not None and not args.chat:
        _usage(parser, "argument --system: needs --chat")
    if args.prompt_file is not None:
        try:
            args.prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            _usage(parser, f"argument --prompt-file: cannot read {args.prompt_file}: {e}")
    elif args.prompt is None:
        if args.chat:
            _usage(parser, "argument --chat: needs --prompt or --prompt-file")
        args.prompt = "def "


def entry() -> None:
    """The ``edl`` console script: ``main`` in a process whose malloc uses huge pages
    (``edl.cli.allocator``: the script re-executes itself once to set them)."""
    from edl.cli.allocator import reexec_with_huge_pages

    reexec_with_huge_pages()
    main()


def main(argv: list[str] | None = None) -> None:
    """The ``edl`` command on ``argv`` (default: ``sys.argv[1:]``), in this process."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            config = _train_config(args)
        elif args.command == "generate":
            _check_generate(parser, args)
        elif args.command == "serve":
            _check_serve(args)
        elif args.command == "eval":
            _check_eval(args)
    except ConfigError as e:
        parser.exit(2, f"edl {args.command}: error: {e}\n")
    try:  # the commands import jax: only after every option was checked
        _run(args, config if args.command == "train" else None)
    except ConfigError as e:  # an option that needed jax to check (--mesh vs the devices)
        parser.exit(2, f"edl {args.command}: error: {e}\n")
    except CommandError as e:
        parser.exit(1, f"edl {args.command}: error: {e}\n")


_COMPILING = ("train", "generate", "serve", "export", "eval")
"""The commands that compile programs, and so use jax's persistent compilation cache."""


def _run(args: argparse.Namespace, config: TrainConfig | None) -> None:
    if args.command in _COMPILING:
        _compile_cache()
    if config is not None:
        from edl.cli.train import run_train

        run_train(config)
    elif args.command == "generate":
        from edl.cli.generate import run_generate

        run_generate(args)
    elif args.command == "export":
        from edl.cli.export import run_export

        run_export(args.source, args.out_dir, merge_lora=args.merge_lora, dtype=args.dtype)
    elif args.command == "serve":
        from edl.cli.serve import run_serve

        run_serve(args)
    elif args.command == "eval":
        from edl.cli.evaluate import run_eval

        run_eval(args)
    else:
        from edl.cli.info import run_info

        run_info(args.path)
