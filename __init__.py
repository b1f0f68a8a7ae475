"""Not a package: the root of an edl clone.

Python imports this file as ``edl`` only when a clone named ``edl`` sits in a directory on
``sys.path`` (usually the current one: Python run from the clone's parent) and ``import edl``
finds the clone instead of the package inside it. Without this file the clone would import as
an empty namespace package and the first use would fail with a bare ``AttributeError: module
'edl' has no attribute ...``. Under any other name (pytest imports the rootdir as a package
named after the clone's directory) it does nothing.
"""

from pathlib import Path

if __name__ == "edl":
    _clone = Path(__file__).resolve().parent
    raise ImportError(
        f"`import edl` found the clone {_clone} instead of the package {_clone / 'edl'}: the "
        f"clone's parent directory is on sys.path (usually the current directory). Run "
        f"Python from another directory (after `pip install -e {_clone}`), or from inside "
        "the clone."
    )
