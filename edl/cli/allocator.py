"""The ``edl`` command's own allocator policy: glibc's malloc asks for huge pages.

XLA:CPU allocates each step's large temporaries afresh on every execution; glibc serves
requests that large with new ``mmap``s, so every 4 KiB page faults in on first touch, step
after step (~40,000 minor faults and 0.1-0.15 s of system time per step of a small Llama
here). ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35+) makes malloc ask for
transparent huge pages instead (``benchmarks/RESULTS.md``: a train step 13% faster, the
default ``edl train`` job 8% faster end to end with less than half the system time).

The tunable is read once, when a process starts, and is a policy for the whole process, so a
library must not set it behind its caller's back: the ``edl`` console script sets it for
itself by re-executing once at start (before anything heavy is imported), and library users
set it in their own environment. ``EDL_HUGE_PAGES=0`` keeps the environment as it is; a
``GLIBC_TUNABLES`` that already says anything of ``glibc.malloc.hugetlb`` is left alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["HUGE_PAGES", "huge_pages_environment", "reexec_with_huge_pages"]

HUGE_PAGES = "glibc.malloc.hugetlb=1"
_MIN_GLIBC = (2, 35)


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # not glibc, or no confstr
        return None


def huge_pages_environment(
    environ: Mapping[str, str], glibc: tuple[int, int] | None
) -> dict[str, str] | None:
    """The environment to re-execute under (``environ`` with ``HUGE_PAGES`` added to its
    ``GLIBC_TUNABLES``), or None to go on as is: turned off by ``EDL_HUGE_PAGES=0``, already
    decided by the caller's ``GLIBC_TUNABLES``, or a C library (``glibc``: its version, None
    when not glibc) without the tunable."""
    if environ.get("EDL_HUGE_PAGES", "1") == "0" or glibc is None or glibc < _MIN_GLIBC:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def reexec_with_huge_pages(arguments: Sequence[str] | None = None) -> None:
    """Replace this process by ``python *arguments`` (default: the running script and its
    arguments) under ``huge_pages_environment`` (same pid and standard streams), when it says
    so; otherwise return. The new process finds the tunable set and goes on. The console
    script passes nothing; a benchmark run as a module passes ``["-m", name, *argv]``."""
    if arguments is None:
        script = sys.argv[0] if sys.argv else ""
        if not os.path.isfile(script):
            return
        arguments = [script, *sys.argv[1:]]
    if sys.platform != "linux":
        return
    environ = huge_pages_environment(os.environ, _glibc_version())
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *arguments], environ)
