"""The documentation site (``mkdocs.yml``, ``docs/``): ``mkdocs build --strict`` passes (the
API reference renders from the docstrings, every page is in the nav, every link resolves),
every public module has its reference, every fenced block says its language, and the Python
blocks of each page run, in order, as one script."""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(path.relative_to(ROOT).as_posix() for path in DOCS.rglob("*.md"))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", flags=re.S | re.M)
# Blocks shown, not run: shell commands (the fine-tune and post-training tutorials' are run by
# tests/test_finetune_readme.py and tests/test_post_training_readme.py), diagrams and outputs,
# files.
SHOWN = {"bash", "text", "toml", "json"}
# Pages whose blocks run in the default suite (a few seconds each); the others take from
# ~10 s to minutes and run in the slow set.
FAST = {"docs/install.md"}


def code_blocks(page: str) -> list[tuple[str, int, str]]:
    """``(language, first line number, code)`` of each fenced block of ``page``."""
    text = (ROOT / page).read_text()
    return [
        (m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
    ]


def run_python_blocks(page: str) -> None:
    """Run ``page``'s Python blocks in one namespace, in order; tracebacks name the page's
    own line numbers."""
    namespace: dict = {"__name__": "__main__"}
    for language, line, code in code_blocks(page):
        if language == "python":
            exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)


RUNNABLE = [page for page in PAGES if any(lang == "python" for lang, _, _ in code_blocks(page))]


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=() if p in FAST else pytest.mark.slow) for p in RUNNABLE]
)
def test_the_python_blocks_of_each_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever an example writes lands here
    run_python_blocks(page)


def test_the_tutorials_and_guides_have_code_that_runs():
    """The pages the tests run are the ones that teach by code (a page losing its blocks, or
    a block losing its language, would drop out of the test above unnoticed)."""
    tutorials = ("train-step", "post-training", "serve", "multi-device")
    guides = ("models", "attention", "generation", "vision", "lora-quantization", "training")
    expected = {f"docs/tutorials/{n}.md" for n in tutorials}
    expected |= {f"docs/guides/{n}.md" for n in guides}
    assert expected <= set(RUNNABLE), sorted(expected - set(RUNNABLE))
    assert not FAST - set(RUNNABLE), sorted(FAST - set(RUNNABLE))


def test_every_fenced_block_says_its_language():
    """``python`` blocks run (above); the rest are marked as what they are."""
    unmarked = [
        f"{page}:{line}: {language or '(none)'}"
        for page in [*PAGES, "README.md"]
        for language, line, _ in code_blocks(page)
        if language not in SHOWN | {"python"}
    ]
    assert not unmarked, f"fenced blocks without a known language: {unmarked}"


def test_every_public_module_has_its_api_reference():
    import edl

    modules = {"edl"} | {
        info.name
        for info in pkgutil.walk_packages(edl.__path__, "edl.")
        if not any(part.startswith("_") for part in info.name.split("."))
    }
    reference = "\n".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
    rendered = set(re.findall(r"^::: (edl[\w.]*)$", reference, flags=re.M))
    assert not modules - rendered, f"modules without a ::: block: {sorted(modules - rendered)}"
    assert not rendered - modules, f"::: blocks of no public module: {sorted(rendered - modules)}"


def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning (``strict: true``): docstrings render, every page is
    in the nav, links and anchors resolve."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr
    for page in ("index.html", "reference/edl.io/index.html", "tutorials/train-step/index.html"):
        assert (site / page).is_file(), page
