"""The CLI's re-execution with glibc's huge-page tunable (jgrpo.huge_pages)."""

import os
import subprocess
import sys

from jgrpo.huge_pages import (
    KEEP_MEMORY,
    huge_page_environment,
    keeps_memory,
    local_huge_page_environment,
    runs_on_host_only,
    transparent_huge_page_mode,
)

LINUX = dict(platform="linux", libc="glibc 2.36", thp_mode="madvise")


def test_the_tunable_is_added_only_where_it_helps():
    assert huge_page_environment({"A": "1"}, **LINUX) == {
        "A": "1",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    }
    joined = huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **LINUX)
    assert joined["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert huge_page_environment({}, **{**LINUX, "libc": "glibc 2.35"}) is not None
    # Nothing to gain, or no way to ask:
    assert huge_page_environment({}, **{**LINUX, "thp_mode": "always"}) is None
    assert huge_page_environment({}, **{**LINUX, "thp_mode": "never"}) is None
    assert huge_page_environment({}, **{**LINUX, "thp_mode": None}) is None
    assert huge_page_environment({}, **{**LINUX, "libc": "glibc 2.34"}) is None
    assert huge_page_environment({}, **{**LINUX, "libc": ""}) is None
    assert huge_page_environment({}, **{**LINUX, "platform": "darwin"}) is None
    # The user's own setting wins, whatever its value.
    for chosen in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"):
        assert huge_page_environment({"GLIBC_TUNABLES": chosen}, **LINUX) is None


def test_on_the_host_alone_freed_memory_is_kept_too():
    keep = ":".join(KEEP_MEMORY)
    host = huge_page_environment({}, **LINUX, host_only=True)
    assert host == {"GLIBC_TUNABLES": f"glibc.malloc.hugetlb=1:{keep}"}
    assert "mmap_max=0" in keep and "trim_threshold" in keep and "arena_max" not in keep
    # A tunable the user set stays as set; the others are added.
    mine = huge_page_environment(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, **LINUX, host_only=True
    )
    assert mine["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:"
        "glibc.malloc.trim_threshold=17179869184"
    )
    # Kept whatever the kernel's mode, with glibc's own hugetlb=0 as the mark of the re-execution.
    for mode in ("always", "never", None):
        kept = huge_page_environment({}, **{**LINUX, "thp_mode": mode}, host_only=True)
        assert kept == {"GLIBC_TUNABLES": f"glibc.malloc.hugetlb=0:{keep}"}
    older = huge_page_environment({}, **{**LINUX, "libc": "glibc 2.31"}, host_only=True)
    assert older == {"GLIBC_TUNABLES": f"glibc.malloc.hugetlb=0:{keep}"}
    # No tunables before glibc 2.26; the user's hugetlb keeps every tunable out.
    assert huge_page_environment({}, **{**LINUX, "libc": "glibc 2.25"}, host_only=True) is None
    declined = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert huge_page_environment(declined, **LINUX, host_only=True) is None


def test_host_only_means_no_accelerator_platform_and_no_accelerator_device(tmp_path):
    nothing = (str(tmp_path / "nvidia[0-9]*"),)
    (tmp_path / "accel0").touch()
    a_tpu = (str(tmp_path / "accel[0-9]*"),)
    assert runs_on_host_only({}, nothing)
    assert not runs_on_host_only({}, a_tpu)
    assert runs_on_host_only({"JAX_PLATFORMS": "cpu"}, a_tpu)  # the user's choice wins
    assert not runs_on_host_only({"JAX_PLATFORMS": "cuda"}, nothing)
    assert not runs_on_host_only({"JAX_PLATFORMS": "cpu,tpu"}, nothing)
    assert runs_on_host_only({"JAX_PLATFORMS": ""}, nothing)


def test_programs_run_on_the_calling_thread_only_where_memory_is_kept():
    kept = {"GLIBC_TUNABLES": ":".join(["glibc.malloc.hugetlb=1", *KEEP_MEMORY])}
    on_cpu = {**kept, "JAX_PLATFORMS": "cpu"}
    assert keeps_memory(on_cpu)
    assert not keeps_memory({**kept, "JAX_PLATFORMS": "cuda"})  # an accelerator's host
    assert not keeps_memory({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "JAX_PLATFORMS": "cpu"})
    assert not keeps_memory({"JAX_PLATFORMS": "cpu"})
    # mmap_max=0 set by the user counts too; another value does not.
    assert keeps_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0", "JAX_PLATFORMS": "cpu"})
    assert not keeps_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=10", "JAX_PLATFORMS": "cpu"})


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_page_mode(str(setting)) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert transparent_huge_page_mode(str(setting)) == "always"
    assert transparent_huge_page_mode(str(tmp_path / "missing")) is None


# Re-executes itself when the tunables help, then twice fills 64 MiB of fresh malloc'd memory
# and frees it; prints the tunables it runs with and the minor page faults of each fill.
_CHILD = """
import resource
from jgrpo.huge_pages import reexec_with_huge_pages
reexec_with_huge_pages()
import os
def fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(64 << 20)  # malloc'd, zeroed
    block[::4096] = b"x" * (len(block) // 4096)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first = fill()
print(repr(os.environ.get("GLIBC_TUNABLES", "")), first, fill())
"""


def _run_child(environ):
    """(GLIBC_TUNABLES as the child ran with it, repr'd; the page faults of each fill)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=environ, capture_output=True, text=True, check=True
    )
    lines = done.stdout.split("\n")[:-1]
    assert len(lines) == 1, done.stdout  # one run printed: no second re-execution
    tunables, first, second = lines[0].rsplit(" ", 2)
    return tunables, int(first), int(second)


def test_the_process_runs_again_with_the_tunables_and_takes_fewer_page_faults():
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAX_PLATFORMS")}
    expected = local_huge_page_environment(environ)
    tunables, first, second = _run_child(environ)
    if expected is None:  # no choice here: it runs as it is
        assert tunables == "''"
        return
    assert tunables == repr(expected["GLIBC_TUNABLES"])
    madvise = transparent_huge_page_mode() == "madvise"
    # 16384 pages of 4 KiB, or 31-32 of 2 MiB plus at most 513 of 4 KiB where the mapping's
    # ends are not 2 MiB-aligned (and a few for the interpreter's own writes).
    if madvise:
        assert first < 1000, first
    if runs_on_host_only(environ):  # the second fill reuses the memory the first freed
        assert tunables == repr(":".join([f"glibc.malloc.hugetlb={int(madvise)}", *KEEP_MEMORY]))
        assert second < 16, second
    else:
        assert tunables == repr("glibc.malloc.hugetlb=1")
    if not madvise:
        return
    # On an accelerator's host: 2 MiB pages, freed memory goes back to the kernel.
    tunables, first, second = _run_child({**environ, "JAX_PLATFORMS": "cuda"})
    assert tunables == repr("glibc.malloc.hugetlb=1")
    assert first < 1000 and second > 16, (first, second)
    # Declined by the user: no re-execution, one fault per 4 KiB page.
    tunables, first, second = _run_child({**environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert tunables == repr("glibc.malloc.hugetlb=0")
    assert first >= 16384 and second >= 16384, (first, second)


# Starts as the CLI does (with the argument "cli"); then runs a program with a 128 MiB buffer
# of XLA's own (and a 128 MiB result) twelve times; prints whether JAX dispatches
# asynchronously and the minor page faults of each of the last nine calls.
_JAX_CHILD = """
import resource
import sys
from jgrpo.huge_pages import reexec_with_huge_pages
if sys.argv[1:] == ["cli"]:
    reexec_with_huge_pages()
import jax
import jax.numpy as jnp

@jax.jit
def twice_summed(x):
    summed = jnp.cumsum(x)  # [N]: no fusion into the product
    return summed * jnp.flip(summed)

x = jnp.ones(1 << 25, jnp.float32)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    twice_summed(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(jax.config.values["jax_cpu_enable_async_dispatch"], *faults[3:])
"""


def test_on_the_host_alone_xla_reuses_its_buffers_without_page_faults():
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAX_PLATFORMS")}
    environ["JAX_PLATFORMS"] = "cpu"
    environ["XLA_FLAGS"] = ""  # the suite's unoptimised code would take 5x as long; one device

    def run(environ, start="cli"):
        done = subprocess.run(
            [sys.executable, "-c", _JAX_CHILD, start],
            env=environ,
            capture_output=True,
            text=True,
            check=True,
        )
        asynchronous, *faults = done.stdout.split()
        return asynchronous == "True", sorted(int(count) for count in faults)

    if local_huge_page_environment(environ) is None:  # no tunables here: nothing is kept
        assert run(environ)[0]
        return
    # Most calls reuse freed memory whole (a fault per page touched anew); the heap still
    # grows now and then while a freed buffer is not yet back (one 128 MiB buffer: 64 faults).
    asynchronous, faults = run(environ)
    assert not asynchronous and faults[4] < 16, faults  # the median of nine calls
    # The same tunables, but programs on XLA's worker thread: its buffers are mapped afresh
    # on every call, 64 faults or more each in 2 MiB pages.
    kept = ":".join(["glibc.malloc.hugetlb=1", *KEEP_MEMORY])
    asynchronous, faults = run({**environ, "GLIBC_TUNABLES": kept}, start="plain")
    assert asynchronous and faults[0] > 64, faults
