"""The README's tour runs as written, CI runs the README's test command, and the names the
README and the docs pages give exist (the docs' code blocks and site: tests/test_docs.py); the
README's model table lists every model_type edl builds."""

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {
    path.relative_to(ROOT).as_posix(): path.read_text() for path in (ROOT / "docs").rglob("*.md")
}
MODULE_TABLE = ROOT / "docs" / "reference" / "index.md"


def test_readme_tours_run():
    """The README's one tour (the rest of the manual is docs/, run by tests/test_docs.py)."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md", "exec"), {})


def test_readme_links_to_every_docs_page():
    """The README is the way in: it links to each page of the site (the API reference through
    its index)."""
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README))
    pages = {page for page in DOCS if not page.startswith("docs/reference/")}
    pages.add("docs/reference/index.md")
    assert not pages - linked, f"README.md does not link to {sorted(pages - linked)}"
    assert not linked - set(DOCS), f"README.md links to missing pages {sorted(linked - set(DOCS))}"


def test_ci_runs_the_readme_test_command():
    block = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```\n<!-- /test-command -->", README)
    assert block is not None
    assert "pytest" in block.group(1)
    assert "test-command" in (ROOT / ".ci" / "run").read_text()


def _resolve(dotted: str):
    """The object ``dotted`` ("edl.ops.attention") names: the longest importable module
    prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_dotted_edl_name_in_the_readme_resolves():
    """In the README and every docs page (``edl.io.checkpoint``, ``edl.train.make_dpo_step``)."""
    missing = []
    for page, text in {"README.md": README, **DOCS}.items():
        text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets: file names, not names
        for name in sorted(set(re.findall(r"\bedl(?:\.[A-Za-z_]\w*)+", text))):
            try:
                _resolve(name)
            except (ImportError, AttributeError) as error:
                missing.append(f"{page}: {name}: {error}")
    assert not missing, "\n".join(missing)
    assert len(set(re.findall(r"\bedl(?:\.[A-Za-z_]\w*)+", "".join(DOCS.values())))) > 100


def test_the_module_table_names_what_each_module_holds():
    """Each identifier in backticks in a row of the module table (the API reference's index
    page) is an attribute of the row's module (a submodule only where the row introduces it
    as one: "`name`: ..." or "`name` (...)"), of such a submodule (``edl.io``'s row), of a
    class the row names (``from_hf``), or of ``edl`` itself (``create_state``)."""
    rows = re.findall(
        r"^\| \[?`(edl(?:\.\w+)*)`(?:\]\([\w.]+\.md\))?[^|]*\| (.*) \|$",
        MODULE_TABLE.read_text(),
        flags=re.M,
    )
    assert len(rows) >= 10
    missing = []
    for module_name, text in rows:
        module = importlib.import_module(module_name)
        scopes = [module, importlib.import_module("edl")]
        scopes += [getattr(module, n) for n in re.findall(r"`(\w+)`:", text)]
        names = re.findall(r"`([A-Za-z_]\w*)`", text)
        scopes += [getattr(module, n) for n in names if isinstance(getattr(module, n, None), type)]
        for name in names:
            found = [getattr(s, name) for s in scopes if hasattr(s, name)]
            if not found or (
                all(isinstance(f, types.ModuleType) for f in found)
                and not re.search(rf"`{name}`(:| \()", text)
            ):
                missing.append(f"{module_name}: {name}")
    assert not missing, "the module table names what its module lacks:\n" + "\n".join(missing)


def _public_modules():
    import importlib
    import pkgutil

    import edl

    yield edl
    for info in pkgutil.walk_packages(edl.__path__, "edl."):
        yield importlib.import_module(info.name)


def test_every_exported_name_resolves_and_says_what_it_is():
    """Each ``__all__`` is the module's public API: every name exists, and every exported
    function and class has a docstring (constants and type aliases are documented where
    they are defined)."""
    import inspect

    undocumented, missing = [], []
    for module in _public_modules():
        for name in getattr(module, "__all__", ()):
            if not hasattr(module, name):
                missing.append(f"{module.__name__}.{name}")
                continue
            value = getattr(module, name)
            if inspect.isclass(value):  # its own docstring, not one inherited or generated
                doc = vars(value).get("__doc__") or ""
                documented = doc.strip() and not doc.startswith(f"{value.__name__}(")
            else:
                documented = not inspect.isfunction(value) or inspect.getdoc(value)
            if not documented:
                undocumented.append(f"{module.__name__}.{name}")
    assert not missing, f"__all__ names that do not exist: {missing}"
    assert not undocumented, f"exported without a docstring: {undocumented}"


def test_no_private_name_is_exported():
    exported = [
        f"{module.__name__}.{name}"
        for module in _public_modules()
        for name in getattr(module, "__all__", ())
        if name.startswith("_") and name != "__version__"
    ]
    assert not exported, exported


def test_every_test_a_promise_names_exists():
    """ARCHITECTURE.md's "What edl promises" names the tests that hold each promise: each
    is a test function in tests/, so a renamed or deleted one breaks this, not the doc."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = re.search(r"^## What edl promises\n(.*?)^## ", text, flags=re.S | re.M)
    assert section is not None
    named = set(re.findall(r"`(test_\w+)`", section.group(1)))
    assert len(named) > 20
    defined = {
        m
        for path in (ROOT / "tests").glob("test_*.py")
        for m in re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M)
    }
    assert not named - defined, sorted(named - defined)


def test_the_model_table_lists_every_model_type():
    """The README's model table names each HF ``model_type`` edl builds, and every type it
    names as unsupported raises an error naming what is missing."""
    from edl.models import families, registry

    section = README.split("## Models", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`[^|]*) \|", section, flags=re.M)
    listed = {t for row in rows[1:] for t in re.findall(r"`(\w+)`", row)}  # [0]: header
    built = {t for f in registry.registered() for t in f.hf_names}
    assert listed == built
    for model_type, reason in families.UNSUPPORTED.items():
        assert f"`{model_type}`" in section.split("Not supported", 1)[1]
        with pytest.raises(ValueError, match=re.escape(reason)):
            registry.family_for(model_type)
