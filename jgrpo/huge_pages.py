"""Huge pages and kept memory for XLA's host buffers: a start-up step of `python -m jgrpo.train`.

On CPU, XLA takes each program's temporary buffers from malloc, and buffers this large are
fresh memory mappings, so every call of the update touches its scratch memory anew, in 4 KiB
pages: about 1.6 million page faults and 4 s of system time per update at the SmolLM2-135M
benchmark shapes (docs/benchmarks.md). glibc 2.35 and later can ask the kernel for 2 MiB pages
on those mappings (the `glibc.malloc.hugetlb=1` tunable); where the kernel's transparent huge
pages are in `madvise` mode, which is the common default, that cuts the faults about 300-fold.
In `always` mode the kernel does it already; in `never` mode only keeping memory (below) helps.

Even in 2 MiB pages the fresh mappings cost kernel time on every step (on the 2-core Zen 4
host, about 1,750 faults and 3.5 s of system time a step at that benchmark). Where XLA runs on
the host alone (no accelerator device), whatever the kernel's mode and from glibc 2.26 on,
glibc is also told to keep freed memory for reuse (`KEEP_MEMORY`: large buffers from the heap
instead of their own mappings, a heap never trimmed), and JAX runs each single-device program
on the thread that calls it (`run_programs_on_calling_thread`): glibc gives other threads
arenas of at most 64 MiB heaps and still maps anything larger afresh, so XLA's big buffers must
come from the main thread. From the second step on they are memory the process already holds:
no faults, and at that benchmark the update took 14.0 s against 16.6 s with 2 MiB pages alone,
the rollout 4.5 s against 4.9 s (docs/benchmarks.md). The process then holds its peak memory
for its life, which a training step needs again every step anyway; with an accelerator the host
buffers are transfers and checkpoints, whose peak is better given back.

glibc reads tunables only when a process starts, so the CLI re-executes itself once with the
tunables added to `GLIBC_TUNABLES`. Setting `glibc.malloc.hugetlb` yourself (for instance to 0)
keeps it from doing so; the same variable set before Python starts does the same for notebooks
and library use, where `run_programs_on_calling_thread()` before the first JAX computation
does the rest.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
_NO_MAPPED_CHUNKS = "glibc.malloc.mmap_max=0"
# Freed memory stays in the process: no mmap'd chunks (they are unmapped when freed) and no
# trimming of the heap. Threads other than the main one keep their own arenas (one arena
# for all made compiling and sampling wait on its lock).
KEEP_MEMORY = (
    _NO_MAPPED_CHUNKS,
    "glibc.malloc.trim_threshold=17179869184",  # 16 GiB
)
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
# Device files of accelerators XLA may run on: NVIDIA and AMD GPUs, TPUs.
_ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def huge_page_environment(
    environ: Mapping[str, str],
    *,
    platform: str,
    libc: str,
    thp_mode: str | None,
    host_only: bool = False,
) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the process should run as it is.

    `libc` is `os.confstr("CS_GNU_LIBC_VERSION")` ("glibc 2.36"); `thp_mode` the kernel's
    selected transparent huge page mode ("always", "madvise", "never", None if unknown);
    `host_only` adds `KEEP_MEMORY`, each tunable the user has not set, whatever the mode.
    `glibc.malloc.hugetlb` is 1 where it helps (madvise mode, glibc 2.35 or later) and 0,
    glibc's default, where only the memory is kept: set either way, it marks the process as
    re-executed, and set by the user it keeps every tunable out.
    """
    if platform != "linux":
        return None
    name, _, version = libc.partition(" ")
    if name != "glibc":
        return None
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    huge_pages = thp_mode == "madvise" and (major, minor) >= (2, 35)
    keep_memory = host_only and (major, minor) >= (2, 26)  # glibc's first tunables
    if not (huge_pages or keep_memory):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    chosen = {entry.split("=")[0] for entry in tunables.split(":")}
    if TUNABLE in chosen:
        return None  # the user chose
    added = [f"{TUNABLE}={int(huge_pages)}"]
    if keep_memory:
        added += [entry for entry in KEEP_MEMORY if entry.split("=")[0] not in chosen]
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, *added]))}


def runs_on_host_only(environ: Mapping[str, str], device_patterns=_ACCELERATOR_DEVICES) -> bool:
    """Whether XLA will run on the CPU alone: `JAX_PLATFORMS` names only cpu, or it is unset
    and no accelerator device file exists (checked without starting JAX, which could claim
    a device before the process re-executes)."""
    platforms = [name.strip() for name in environ.get("JAX_PLATFORMS", "").split(",")]
    if any(platforms):
        return all(name == "cpu" for name in platforms if name)
    return not any(glob.glob(pattern) for pattern in device_patterns)


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
        environ,
        platform=sys.platform,
        libc=libc,
        thp_mode=transparent_huge_page_mode(),
        host_only=runs_on_host_only(environ),
    )


def keeps_memory(environ: Mapping[str, str]) -> bool:
    """Whether glibc was told to keep freed memory (`KEEP_MEMORY`'s `mmap_max=0`) and XLA runs
    on the host alone: then its programs should run on the main thread."""
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    return _NO_MAPPED_CHUNKS in tunables and runs_on_host_only(environ)


def run_programs_on_calling_thread() -> None:
    """Makes JAX's CPU client run each single-device program on the thread that calls it
    rather than on a worker thread, so XLA's buffers come from that thread's arena: the main
    heap for the main thread. Must run before JAX starts its CPU backend; a program spread
    over several devices still runs on workers."""
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)


def reexec_with_huge_pages() -> None:
    """Replaces this process by the same command with the tunables set, when they help; in
    the process that runs with them, runs XLA's programs on the calling thread where freed
    memory is kept."""
    environ = local_huge_page_environment(os.environ)
    if environ is None:
        if keeps_memory(os.environ):
            run_programs_on_calling_thread()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environ)
    except OSError:  # run on as we are: slower on CPU, not wrong
        return
