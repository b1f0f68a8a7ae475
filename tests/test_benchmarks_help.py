"""``python -m benchmarks.X --help`` is complete for every script: a description that is the
module docstring's whole first paragraph (not cut mid-sentence), and help text on every option.

Each script builds its command line in ``build_parser()``, which ``main`` parses. One
subprocess imports every script and reports each parser (the scripts set process-wide state
at import, e.g. ``benchmarks.sharding``'s ``XLA_FLAGS``, which must not leak into this one).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every benchmark script with a command line: the files that call ``main()`` as a script.
SCRIPTS = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "benchmarks").rglob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)

REPORT = """
import argparse, importlib, json, sys
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    if not hasattr(module, "build_parser"):
        out[name] = None
        continue
    parser = module.build_parser()
    options = [
        {"flags": a.option_strings, "name": a.dest, "help": a.help}
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    ]
    out[name] = {
        "description": parser.description,
        "doc": module.__doc__,
        "options": options,
        "help": parser.format_help(),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsers() -> dict:
    done = subprocess.run(
        [sys.executable, "-c", REPORT, *SCRIPTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_every_script_is_found():
    assert {"benchmarks.grpo", "benchmarks.serve", "benchmarks.device.run"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_has_the_whole_first_paragraph_and_help_on_every_option(parsers, name):
    report = parsers[name]
    assert report is not None, f"{name} has no build_parser()"
    first = report["doc"].split("\n\n")[0]
    assert report["description"] == first, f"{name}: the description is not the docstring's"
    assert first.rstrip().endswith("."), f"{name}: the first paragraph ends mid-sentence"
    for option in report["options"]:
        text = option["help"]
        assert text and text != "==SUPPRESS==", (
            f"{name} {option['flags'] or option['name']}: no help"
        )
        assert all(flag in report["help"] for flag in option["flags"])


@pytest.mark.parametrize("name", SCRIPTS)
def test_main_parses_build_parser(name):
    """``main`` (or what it calls) parses ``build_parser()``: the help shown is what runs."""
    path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
    calls = [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "build_parser"
    ]
    assert calls, f"{name}: nothing calls build_parser()"
    assert path.read_text().count("ArgumentParser(") == 1, f"{name}: a second parser"
