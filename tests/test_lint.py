"""The code base stays ruff-clean (configured in pyproject.toml)."""

import ast
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (it comes with the 'test' extra)")
    result = subprocess.run(
        [exe, "check", "edl", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


_UNSAFE_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
_UNSAFE_CALLS = {"eval", "exec", "torch.load", "np.load", "numpy.load", "jnp.load"}
_UNSAFE_FLAGS = {"allow_pickle", "trust_remote_code"}


def _unsafe(tree: ast.AST) -> list[str]:
    """Imports and calls in ``tree`` through which a file's bytes could become code."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [f"import {n}" for n in names if n and n.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            if ast.unparse(node.func) in _UNSAFE_CALLS:
                found.append(f"call {ast.unparse(node.func)}")
            for kw in node.keywords:
                if kw.arg in _UNSAFE_FLAGS and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    found.append(f"{kw.arg}={ast.unparse(kw.value)}")
    return found


def test_no_code_runs_from_files():
    """What edl reads is data (ARCHITECTURE.md, "What edl promises"): no pickle or its
    relatives, no ``eval`` / ``exec``, no ``torch.load`` / ``np.load``, and
    ``trust_remote_code`` / ``allow_pickle`` only ever ``False``."""
    offences = {}
    for path in sorted((ROOT / "edl").rglob("*.py")):
        found = _unsafe(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offences[str(path.relative_to(ROOT))] = found
    assert not offences, offences
    bad = "import pickle\nnp.load(f, allow_pickle=True)\nexec(s)\nAuto(p, trust_remote_code=x)"
    assert len(_unsafe(ast.parse(bad))) == 5  # the scan itself finds what it looks for


def test_ruff_format_wins():
    """``ruff format`` decides the layout: a ``# fmt: skip`` / ``# fmt: off`` comment is kept
    only for a table whose alignment is the point, and then says so on the same line
    (``# fmt: skip  # a table: ...``)."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b(?P<rest>.*)$")
    bare = []
    for folder in ("edl", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            with path.open("rb") as f:
                comments = [t for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
            for token in comments:
                found = marker.match(token.string)
                if found and not found["rest"].strip().startswith("#"):
                    bare.append(f"{path.relative_to(ROOT)}:{token.start[0]}")
    assert not bare, f"'# fmt: skip' without a reason: {bare[:20]} ({len(bare)} in all)"
