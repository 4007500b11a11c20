"""The CLI's re-execution with glibc's huge-page tunable (jgrpo.huge_pages)."""

import os
import subprocess
import sys

from jgrpo.huge_pages import (
    huge_page_environment,
    local_huge_page_environment,
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


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_page_mode(str(setting)) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert transparent_huge_page_mode(str(setting)) == "always"
    assert transparent_huge_page_mode(str(tmp_path / "missing")) is None


# Re-executes itself when the tunable helps, then fills 64 MiB of fresh malloc'd memory and
# prints the tunables it runs with and the minor page faults that filling it took.
_CHILD = """
import resource
from jgrpo.huge_pages import reexec_with_huge_pages
reexec_with_huge_pages()
import os
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(64 << 20)  # one fresh malloc'd mapping, zeroed
block[::4096] = b"x" * (len(block) // 4096)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(repr(os.environ.get("GLIBC_TUNABLES", "")), faults)
"""


def _run_child(environ):
    """(GLIBC_TUNABLES as the child ran with it, repr'd; the page faults of filling 64 MiB)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=environ, capture_output=True, text=True, check=True
    )
    lines = done.stdout.split("\n")[:-1]
    assert len(lines) == 1, done.stdout  # one run printed: no second re-execution
    tunables, faults = lines[0].rsplit(" ", 1)
    return tunables, int(faults)


def test_the_process_runs_again_with_the_tunable_and_takes_fewer_page_faults():
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tunables, faults = _run_child(environ)
    if local_huge_page_environment(environ) is None:  # no choice here: it runs as it is
        assert tunables == "''"
        return
    assert tunables == repr("glibc.malloc.hugetlb=1")
    # 16384 pages of 4 KiB, or 31-32 of 2 MiB plus at most 513 of 4 KiB where the mapping's
    # ends are not 2 MiB-aligned (and a few for the interpreter's own writes).
    assert faults < 1000, faults
    # Declined by the user: no re-execution, one fault per 4 KiB page.
    tunables, faults = _run_child({**environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert tunables == repr("glibc.malloc.hugetlb=0")
    assert faults >= 16384, faults
