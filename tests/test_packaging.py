"""The distribution: its name and extras as the code and docs name them, the wheel's files
and metadata, and a CHANGELOG entry for the current version."""

import email.parser
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import edl
from edl.kernels.native import _build

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTION = PROJECT["name"]
EXTRAS = set(PROJECT["optional-dependencies"])

# An extra named in quotes or backticks: 'edl-jax[text]', ``edl-jax[data,vision]``.
_EXTRA_HINT = re.compile(r"[`'\"](edl(?:-[\w-]+)?)\[([a-z][\w,-]*)\]")


def _hints(path: Path) -> list[tuple[str, str, list[str]]]:
    """(place, distribution, extras) for every extra named in ``path``."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for m in _EXTRA_HINT.finditer(line):
            place = f"{path.relative_to(ROOT)}:{number}"
            found.append((place, m.group(1), m.group(2).split(",")))
    return found


def test_the_distribution_name_is_not_the_unrelated_pypi_project():
    """``edl`` on PyPI is someone else's project: the distribution is ``edl-jax``, while the
    import name and the console script stay ``edl``."""
    assert re.sub(r"[-_.]+", "-", DISTRIBUTION).lower() == "edl-jax"
    assert PROJECT["scripts"] == {"edl": "edl.cli:entry"}


def test_install_hints_name_the_distribution_and_its_extras():
    """Every ``pip install 'edl-jax[...]'`` hint in an error message or doc names this
    distribution (not the unrelated PyPI project ``edl``) and extras that exist."""
    package = [h for p in sorted((ROOT / "edl").rglob("*.py")) for h in _hints(p)]
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs = [h for p in documents for h in _hints(p)]
    assert len(package) >= 7  # the ImportErrors of the text, data, vision, serve, trackers
    wrong = [
        f"{place}: {name}[{','.join(extras)}] (expected {DISTRIBUTION}[one of {sorted(EXTRAS)}])"
        for place, name, extras in package + docs
        if name != DISTRIBUTION or not set(extras) <= EXTRAS
    ]
    assert not wrong, "\n".join(wrong)


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel built from a copy of the source (no build files left in the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "edl", src / "edl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*cmd, "--no-index", "-w", str(out), str(src)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_every_package_file_and_the_metadata(tmp_path):
    """The wheel (about a second to build) carries every file under edl/, the native
    kernels' C++ sources included, and says its name, version, license, readme and extras."""
    wheel = _build_wheel(tmp_path)
    stem = DISTRIBUTION.replace("-", "_")
    assert wheel.name == f"{stem}-{edl.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"{stem}-{edl.__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()

    source = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "edl").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    packaged = {n for n in names if n.startswith("edl/")}
    assert source - packaged == set(), "files under edl/ missing from the wheel"
    assert packaged - source == set(), "files in the wheel that edl/ does not hold"
    # The files edl reads at run time: the native kernels' C++ sources, compiled on first use.
    native = {f"edl/kernels/native/{p.name}" for p in _build._SOURCES + _build._HEADERS}
    assert native <= packaged
    assert f"{info}/licenses/LICENSE" in names

    assert metadata["Name"] == DISTRIBUTION
    assert metadata["Version"] == edl.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata["Requires-Python"] == PROJECT["requires-python"]
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    assert "__init__.py" not in names  # the clone's root guard (the import trap) stays out
    assert "edl = edl.cli:entry" in entry_points


def test_changelog_has_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(edl.__version__)}\]", changelog, flags=re.M), (
        f"CHANGELOG.md has no '## [{edl.__version__}]' section (edl.__version__)"
    )


def test_a_clone_named_edl_imported_from_its_parent_says_how_to_fix_it(tmp_path):
    """The import trap: a clone named ``edl`` on sys.path (the current directory) would import
    as an empty namespace package and fail later with a bare AttributeError; the clone's root
    ``__init__.py`` stops it at import, naming the clone and the fix."""
    (tmp_path / "edl").symlink_to(ROOT, target_is_directory=True)
    done = subprocess.run(
        [sys.executable, "-c", "import edl"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: `import edl` found the clone"), done.stderr
    assert f"pip install -e {ROOT}" in last
