"""The layering holds: no module under edl/ imports a module of a higher layer.

    base utilities (edl, edl._hub, edl._kv_cache, edl._lazy, edl._mesh_spec, edl._registry,
    edl._settings, edl._speculative, edl.compile_cache, edl.module, edl.platforms, edl.tree):
    any layer may use them
    kernels <- ops <- nn / models / lora / quantize / state <- io / generate / sharding / text
                                                               / images
                                                            <- train / serve / eval / cli

The check reads source only (``ast``, nothing is imported): every ``import edl.x`` and
``from edl.x import y`` (relative ones resolved), at top level or inside a function, is an
edge; a module may import its own layer and those below. docs/ARCHITECTURE.md says what
each layer owns. Lazy forwards (``edl._lazy.lazy_attributes``, e.g. ``edl.lora``'s PEFT
names) load on first use and are not imports.

Inside ``edl.io`` the same holds for its own layers (``IO_LAYERS``)::

    formats (edl.io.formats) <- model files (edl.io.model_files)
        <- checkpoints (edl.io.checkpoint) <- export (edl.io.export)

and the longest chain of imports between its modules stays short (``IO_CHAIN_LIMIT``).
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "edl",
            "edl._lazy",
            "edl._mesh_spec",
            "edl._registry",
            "edl._hub",
            "edl._kv_cache",
            "edl._settings",
            "edl._speculative",
            "edl.compile_cache",
            "edl.module",
            "edl.platforms",
            "edl.tree",
        ),
    ),
    ("kernels", ("edl.kernels",)),
    ("ops", ("edl.ops",)),
    ("models", ("edl.nn", "edl.models", "edl.lora", "edl.quantize", "edl.state")),
    ("io", ("edl.io", "edl.generate", "edl.sharding", "edl.text", "edl.images")),
    ("apps", ("edl.train", "edl.serve", "edl.eval", "edl.cli")),
)


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of ``module`` (by its longest listed package), or None."""
    best, rank = "", None
    for index, (_, packages) in enumerate(LAYERS):
        for package in packages:
            # The root package names only itself: edl.foo is not "base" by being under edl.
            inside = module == package or (package != "edl" and module.startswith(package + "."))
            if inside and len(package) > len(best):
                best, rank = package, index
    return rank


def _module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(
    module: str, source: str, is_module, *, is_package: bool = False
) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import of an ``edl`` module in ``source``, the
    text of ``module`` (``edl.a.b``, a package's ``__init__`` with ``is_package``);
    ``is_module(name)`` tells whether ``from p import n`` imports the module ``p.n`` (else
    an attribute of ``p``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if is_module(name) else base))
    edl = [(line, name) for line, name in found if name == "edl" or name.startswith("edl.")]
    return list(dict.fromkeys(edl))  # `from edl.x import a, b`: one edge


def upward_imports(root: Path) -> list[str]:
    """One line per import of a higher layer (or of a module in no layer) under
    ``root/edl``: ``file:line: importer (layer) imports target (layer)``."""

    def is_module(name: str) -> bool:
        path = root.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    def describe(module: str, rank: int | None) -> str:
        return f"{module} ({'no layer' if rank is None else LAYERS[rank][0]})"

    problems = []
    for file in sorted((root / "edl").rglob("*.py")):
        module = _module_name(root, file)
        rank = layer_of(module)
        where = file.relative_to(root).as_posix()
        if rank is None:
            problems.append(f"{where}:1: {module} is in no layer; add it to LAYERS")
            continue
        source = file.read_text(encoding="utf-8")
        is_package = file.name == "__init__.py"
        for line, target in imports_of(module, source, is_module, is_package=is_package):
            target_rank = layer_of(target)
            if target_rank is None or target_rank > rank:
                problems.append(
                    f"{where}:{line}: {describe(module, rank)} imports "
                    f"{describe(target, target_rank)}"
                )
    return problems


def test_layering_no_module_imports_a_higher_layer():
    problems = upward_imports(ROOT)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_layering_check_reports_every_kind_of_upward_import(tmp_path):
    _write(
        tmp_path,
        {
            "edl/__init__.py": "",
            "edl/tree.py": "",
            "edl/kernels/__init__.py": "",
            "edl/ops/__init__.py": "from edl.kernels import flash\n",  # downward: fine
            "edl/ops/bad.py": """\
            import edl.tree
            from edl import tree
            from edl.ops import helpers


            def f():
                from edl.train import loop  # function-local, upward
                return loop
            """,
            "edl/ops/helpers.py": "import edl.io.hf\n",  # upward at top level
            "edl/nn/__init__.py": "from ..generate import decode\n",  # relative, upward
            "edl/kernels/flash.py": "from edl import ops\n",  # `from edl import <module>`
            "edl/mystery.py": "",  # in no layer
            "edl/io/__init__.py": "",
            "edl/io/hf.py": "from edl.models import registry\n",  # downward: fine
            "edl/generate/__init__.py": "",
            "edl/generate/decode.py": "",
            "edl/train/__init__.py": "",
            "edl/train/loop.py": "from edl.io import hf\nimport edl\n",  # downward: fine
        },
    )
    assert upward_imports(tmp_path) == [
        "edl/kernels/flash.py:1: edl.kernels.flash (kernels) imports edl.ops (ops)",
        "edl/mystery.py:1: edl.mystery is in no layer; add it to LAYERS",
        "edl/nn/__init__.py:1: edl.nn (models) imports edl.generate.decode (io)",
        "edl/ops/bad.py:7: edl.ops.bad (ops) imports edl.train.loop (apps)",
        "edl/ops/helpers.py:1: edl.ops.helpers (ops) imports edl.io.hf (io)",
    ]


def test_layering_knows_every_package_under_edl():
    packages = {p.name for p in (ROOT / "edl").iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in (ROOT / "edl").glob("*.py") if p.stem != "__init__"}
    unplaced = sorted(n for n in packages | modules if layer_of(f"edl.{n}") is None)
    assert not unplaced, f"add these to LAYERS (and docs/ARCHITECTURE.md): {unplaced}"


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module under ``root/edl`` (packages' ``__init__`` left out: a package re-exports
    its modules' names, and a module importing a name from its package is no cycle of
    code) and the modules it imports, at top level or inside functions."""

    def is_module(name: str) -> bool:
        path = root.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    graph = {}
    for file in sorted((root / "edl").rglob("*.py")):
        if file.name != "__init__.py":
            module = _module_name(root, file)
            targets = imports_of(module, file.read_text(encoding="utf-8"), is_module)
            graph[module] = {target for _, target in targets if target != module}
    return {module: targets & graph.keys() for module, targets in graph.items()}


def test_no_import_cycle():
    """No module imports, directly or through others, a module that imports it back (a
    function-local import included: it only hides the cycle from Python)."""
    import graphlib

    try:
        tuple(graphlib.TopologicalSorter(import_graph(ROOT)).static_order())
    except graphlib.CycleError as error:
        raise AssertionError(f"import cycle: {' -> '.join(error.args[1])}") from None
    cyclic = {"edl.a": {"edl.b"}, "edl.b": {"edl.a"}}
    with pytest.raises(graphlib.CycleError):  # the check finds what it looks for
        tuple(graphlib.TopologicalSorter(cyclic).static_order())


# -- inside edl.io -------------------------------------------------------------------------

IO_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("formats", ("edl.io.formats",)),
    ("model files", ("edl.io.model_files",)),
    ("checkpoints", ("edl.io.checkpoint",)),
    ("export", ("edl.io.export",)),
)
IO_FACADE = "edl.io"  # the package's __init__: what users import, above every io layer
IO_CHAIN_LIMIT = 7
"""Modules on the longest import chain inside ``edl.io`` (10 before its split into layers:
export -> checkpoint -> model_files -> peft -> hf -> plan -> safetensors -> writer ->
reader -> files)."""


def _io_layer_of(module: str) -> int | None:
    for index, (_, packages) in enumerate(IO_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    return None


def _io_graph(root: Path) -> dict[str, set[str]]:
    """Each module under ``root/edl/io`` (a package's ``__init__`` as the package) and the
    ``edl.io`` modules it imports, top level or inside functions."""

    def is_module(name: str) -> bool:
        path = root.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    graph = {}
    for file in sorted((root / "edl" / "io").rglob("*.py")):
        module = _module_name(root, file)
        package = file.name == "__init__.py"
        found = imports_of(module, file.read_text(encoding="utf-8"), is_module, is_package=package)
        inside = {t for _, t in found if t == IO_FACADE or t.startswith(IO_FACADE + ".")}
        graph[module] = inside - {module}
    return graph


def upward_io_imports(root: Path) -> list[str]:
    """One line per import, inside ``edl.io``, of a module of a higher io layer, of the
    ``edl.io`` facade, or by a module in no io layer."""
    problems = []
    for module, targets in sorted(_io_graph(root).items()):
        if module == IO_FACADE:
            continue
        rank = _io_layer_of(module)
        if rank is None:
            problems.append(f"{module} is in no io layer; add it to IO_LAYERS")
            continue
        for target in sorted(targets):
            target_rank = _io_layer_of(target)
            if target_rank is None or target_rank > rank:
                where = "no io layer" if target_rank is None else IO_LAYERS[target_rank][0]
                problems.append(f"{module} ({IO_LAYERS[rank][0]}) imports {target} ({where})")
    return problems


def longest_io_chain(root: Path) -> tuple[str, ...]:
    """The longest chain of imports between ``edl.io`` modules, starting at a module (a
    package's ``__init__`` is a facade, but importing a package imports what it does)."""
    graph = _io_graph(root)

    @functools.cache
    def longest(module: str) -> tuple[str, ...]:
        chains = [(module, *longest(t)) for t in graph.get(module, ())]
        return max(chains, key=len, default=(module,))

    starts = [m for m in graph if not (root.joinpath(*m.split(".")) / "__init__.py").is_file()]
    return max((longest(m) for m in starts), key=len)


def test_io_layers_import_only_downward():
    problems = upward_io_imports(ROOT)
    assert not problems, "upward imports inside edl.io:\n" + "\n".join(problems)


def test_io_import_chain_stays_flat():
    chain = longest_io_chain(ROOT)
    assert len(chain) <= IO_CHAIN_LIMIT, " -> ".join(chain)


def test_io_layer_check_reports_upward_imports(tmp_path):
    _write(
        tmp_path,
        {
            "edl/io/__init__.py": "",  # the facade (it may import anything)
            "edl/io/formats/__init__.py": "",
            "edl/io/formats/hf.py": "from edl.io.formats import files\n",  # same layer
            "edl/io/formats/files.py": "def f():\n    from edl.io import export\n",
            "edl/io/model_files.py": "import edl.io.checkpoint.state\n",
            "edl/io/checkpoint/__init__.py": "",
            "edl/io/checkpoint/state.py": "from edl.io.formats import hf\n",  # downward
            "edl/io/export.py": "from edl.io import hf\n",  # the facade's name
            "edl/io/stray.py": "",
        },
    )
    assert upward_io_imports(tmp_path) == [
        "edl.io.export (export) imports edl.io (no io layer)",
        "edl.io.formats.files (formats) imports edl.io.export (export)",
        "edl.io.model_files (model files) imports edl.io.checkpoint.state (checkpoints)",
        "edl.io.stray is in no io layer; add it to IO_LAYERS",
    ]
    assert longest_io_chain(tmp_path) == (
        "edl.io.model_files",
        "edl.io.checkpoint.state",
        "edl.io.formats.hf",
        "edl.io.formats.files",
        "edl.io.export",
        "edl.io",
    )
