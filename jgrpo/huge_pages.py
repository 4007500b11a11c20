"""Transparent huge pages for XLA's host buffers: a start-up step of `python -m jgrpo.train`.

On CPU, XLA takes each program's temporary buffers from malloc, and buffers this large are
fresh memory mappings, so every call of the update touches its scratch memory anew, in 4 KiB
pages: about 1.6 million page faults and 4 s of system time per update at the SmolLM2-135M
benchmark shapes (docs/benchmarks.md). glibc 2.35 and later can ask the kernel for 2 MiB pages
on those mappings (the `glibc.malloc.hugetlb=1` tunable); where the kernel's transparent huge
pages are in `madvise` mode, which is the common default, that cuts the faults about 300-fold.
In `always` mode the kernel does it already; in `never` mode nothing helps.

glibc reads tunables only when a process starts, so the CLI re-executes itself once with the
tunable added to `GLIBC_TUNABLES`. Setting `glibc.malloc.hugetlb` yourself (for instance to 0)
keeps it from doing so; the same variable set before Python starts does the same for notebooks
and library use.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_environment(
    environ: Mapping[str, str],
    *,
    platform: str,
    libc: str,
    thp_mode: str | None,
) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the process should run as it is.

    `libc` is `os.confstr("CS_GNU_LIBC_VERSION")` ("glibc 2.36"); `thp_mode` the kernel's
    selected transparent huge page mode ("always", "madvise", "never", None if unknown).
    """
    if platform != "linux" or thp_mode != "madvise":
        return None
    name, _, version = libc.partition(" ")
    if name != "glibc":
        return None
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (2, 35):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(entry.split("=")[0] == TUNABLE for entry in tunables.split(":")):
        return None  # the user chose
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))}


def transparent_huge_page_mode(path: str = _THP_SETTING) -> str | None:
    """The kernel's selected mode, the bracketed word of `always [madvise] never`."""
    try:
        with open(path) as setting:
            words = setting.read().split()
    except OSError:
        return None
    return next((word[1:-1] for word in words if word.startswith("[")), None)


def local_huge_page_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`huge_page_environment` for this machine's platform, libc and kernel setting."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # not glibc, or not POSIX
        return None
    return huge_page_environment(
        environ, platform=sys.platform, libc=libc, thp_mode=transparent_huge_page_mode()
    )


def reexec_with_huge_pages() -> None:
    """Replaces this process by the same command with the tunable set, when it helps."""
    environ = local_huge_page_environment(os.environ)
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environ)
    except OSError:  # run on as we are: slower on CPU, not wrong
        return
