"""The sandbox: ordinary programs run; each attack fails, is bounded, and harms nothing.

Every run uses a short timeout and a small memory cap, so the file stays fast on a small
machine; "harms nothing" is checked after the fact (files intact, no stray processes, the
working directory gone).
"""

import os
import time

import pytest

from jgrpo.rewards.sandbox import run_many, run_python

TIMEOUT = 2.0
LIMITS = {"timeout_s": TIMEOUT, "memory_mb": 256}


def run(code, **kwargs):
    return run_python(code, **{**LIMITS, **kwargs})


def sandbox_processes():
    """Pids of live sandbox children (their command line holds the bootstrap and directory)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    cmdline = file.read()
            except OSError:
                continue  # it ended meanwhile
            if b"_child_main()" in cmdline and b"jgrpo-sandbox-" in cmdline:
                pids.append(int(entry))
    return pids


def assert_refused(result, *expected):
    assert not result.ok and not result.timed_out, result
    assert any(word in result.stderr for word in expected), result.stderr


def test_ordinary_program_runs_with_imports_stdin_and_files():
    code = """
import collections, functools, itertools, json, math, os, re, shutil, tempfile
from dataclasses import dataclass

@dataclass
class Point:
    x: int

n = int(input())
words = re.findall(r"\\w+", "a b a c")
counts = collections.Counter(words)
total = functools.reduce(lambda a, b: a + b, itertools.islice(itertools.count(), n))
with open("scratch.txt", "w") as f:
    f.write(json.dumps({"sqrt": math.isqrt(49)}))
os.makedirs("a/b/c")
shutil.rmtree("a")
with tempfile.TemporaryDirectory() as tmp:
    os.mkdir(os.path.join(tmp, "d"))
print(total, counts["a"], open("scratch.txt").read(), Point(1), sorted(os.listdir(".")))
"""
    result = run(code, stdin="5\n")
    assert result.ok, result.stderr
    assert result.stdout == "10 2 {\"sqrt\": 7} Point(x=1) ['main.py', 'scratch.txt']\n"
    assert (result.returncode, result.timed_out, result.killed_reason) == (0, False, None)
    assert not result.output_truncated


def test_isolated_interpreter_and_minimal_environment():
    code = "import os, sys; print(sorted(os.environ), sys.flags.isolated, sys.flags.no_site)"
    result = run(code)
    assert result.ok, result.stderr
    assert result.stdout == "['HOME', 'LC_ALL', 'PATH', 'TMPDIR'] 1 1\n"


def test_exit_codes_and_exceptions():
    assert run("exit(3)").returncode == 3
    failed = run("def f():\n    raise ValueError('boom')\nf()")
    assert not failed.ok and failed.returncode == 1
    assert "ValueError: boom" in failed.stderr and 'main.py", line 2' in failed.stderr
    assert not run("def f(:\n").ok  # a syntax error


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run("while True:\n    pass")
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok
    assert result.killed_reason == "timeout" and result.returncode < 0
    assert TIMEOUT <= elapsed < TIMEOUT + 1.0
    assert not sandbox_processes()


def test_fork_bomb_fails_and_leaves_no_process():
    before = sandbox_processes()
    start = time.monotonic()
    result = run("import os\nwhile True:\n    os.fork()")
    assert_refused(result, "os.fork is not allowed")
    # Even a bomb that swallows every refusal gets no process and ends on its own.
    stubborn = run(
        "import os\nrefused = 0\nfor _ in range(1000):\n    try:\n        os.fork()\n"
        "    except OSError:\n        refused += 1\nprint(refused)"
    )
    assert stubborn.ok and stubborn.stdout == "1000\n", stubborn.stderr
    assert time.monotonic() - start < TIMEOUT
    assert before == [] and sandbox_processes() == []


def test_huge_allocation_raises_memory_error():
    result = run("x = bytearray(10**10)")
    assert_refused(result, "MemoryError")


@pytest.mark.parametrize(
    "attack",
    [
        "data = open('/etc/passwd').read()",
        "data = open(SECRET).read()",
        "import pathlib; data = pathlib.Path(SECRET).read_text()",
        "data = os.read(os.open(SECRET, os.O_RDONLY), 100)",
        "data = open('../../../../../../../..' + SECRET).read()",
        "os.chdir('/'); data = open('etc/passwd').read()",
        "data = os.listdir(os.path.dirname(SECRET))",
        "data = open('/proc/self/environ').read()",
        "import shutil; shutil.copy(SECRET, 'copy.txt'); data = open('copy.txt').read()",
    ],
)
def test_reading_outside_the_sandbox_fails(tmp_path, attack):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    result = run(f"import os\nSECRET = {str(secret)!r}\n{attack}\nprint(data)")
    assert_refused(result, "PermissionError: sandbox")
    assert "TOP-SECRET" not in result.stdout and "root:" not in result.stdout


@pytest.mark.parametrize(
    "attack",
    [
        "open(VICTIM, 'w').write('gone')",
        "open(VICTIM, 'a').write('gone')",
        "import pathlib; pathlib.Path(VICTIM).write_text('gone')",
        "import os; os.write(os.open(VICTIM, os.O_WRONLY | os.O_TRUNC), b'gone')",
        "import os; os.remove(VICTIM)",
        "import os; os.unlink(VICTIM)",
        "import os; os.rename(VICTIM, VICTIM + '.moved')",
        "import os; open('mine', 'w').close(); os.replace('mine', VICTIM)",
        "import os; os.truncate(VICTIM, 0)",
        "import os; os.chmod(VICTIM, 0)",
        "import os; os.rmdir(EMPTY)",
        "import shutil; shutil.rmtree(os.path.dirname(VICTIM))",
        "import shutil; shutil.copy('main.py', VICTIM)",
        "import os; os.symlink(VICTIM, 'link'); open('link', 'w').write('gone')",
        "import os; os.link(VICTIM, 'hard'); open('hard', 'w').write('gone')",
    ],
)
def test_deleting_or_overwriting_outside_the_sandbox_fails(tmp_path, attack):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    mode = victim.stat().st_mode
    (tmp_path / "empty").mkdir()
    names = f"VICTIM = {str(victim)!r}\nEMPTY = {str(tmp_path / 'empty')!r}"
    result = run(f"import os\n{names}\n{attack}")
    assert_refused(result, "PermissionError: sandbox")
    assert victim.read_text() == "precious" and victim.stat().st_mode == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "victim.txt"]


@pytest.mark.parametrize(
    "attack",
    [
        "open(os.path.join(STDLIB, 'evil.py'), 'w')",
        "open(os.__file__, 'a')",
        # os.open's audit event has no dir_fd, so a relative os.open is refused.
        "os.open('evil.py', os.O_WRONLY | os.O_CREAT, dir_fd=os.open(STDLIB, os.O_RDONLY))",
    ],
)
def test_the_python_installation_is_read_only(attack):
    stdlib = os.path.dirname(os.__file__)
    result = run(f"import os\nSTDLIB = os.path.dirname(os.__file__)\n{attack}")
    assert_refused(result, "PermissionError: sandbox")
    assert not os.path.exists(os.path.join(stdlib, "evil.py"))


@pytest.mark.parametrize(
    "attack",
    [
        "import socket; socket.socket().connect(('127.0.0.1', 9))",
        "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket; socket.getaddrinfo('localhost', 80)",
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9', timeout=1)",
    ],
)
def test_network_fails(attack):
    assert_refused(run(attack), "socket.")


@pytest.mark.parametrize(
    "attack",
    [
        "import subprocess; subprocess.run(['ls'])",
        "import os; os.system('ls')",
        "import os; os.popen('ls').read()",
        "import os; os.execv('/bin/ls', ['ls'])",
        "import os; os.posix_spawn('/bin/ls', ['ls'], {})",
        "import pty; pty.spawn('ls')",
        "import os; os.kill(os.getpid(), 0)",
    ],
)
def test_processes_and_signals_fail(attack):
    assert_refused(run(attack), "sandbox:")
    assert not sandbox_processes()


def test_huge_output_is_capped_keeping_head_and_tail():
    result = run("print('START' + 'x' * 10**8 + 'END')", memory_mb=512, max_output_bytes=10_000)
    assert result.ok, result.stderr
    assert result.output_truncated
    assert len(result.stdout) <= 10_000 + 100
    assert result.stdout.startswith("STARTxxx") and result.stdout.endswith("xxxEND\n")
    assert "bytes cut by the sandbox" in result.stdout


def test_file_writes_inside_the_sandbox_are_capped():
    small = run("open('small.bin', 'wb').write(b'x' * 1000)", max_file_mb=1)
    assert small.ok, small.stderr
    big = run("open('big.bin', 'wb').write(b'x' * (3 << 20))", max_file_mb=1)
    assert_refused(big, "File too large")


def test_total_disk_use_is_bounded_by_the_files_the_program_may_create():
    """Files of max_file_mb each, at most max_files of them: new names, directories, a file
    deleted while still open and made again, and unnamed O_TMPFILE files all count."""
    code = """
import os
made, kept = [], []

def attempt(what, make):
    try:
        make()
        made.append(what)
    except PermissionError as error:
        print(what, error)

def write(name):
    file = open(name, "wb")
    file.write(b"x" * (1 << 20))
    kept.append(file)  # held open: deleting it would not free the space

attempt("a", lambda: write("a"))
attempt("dir", lambda: os.mkdir("d"))
attempt("a again", lambda: (os.remove("a"), write("a")))
attempt("tmpfile", lambda: os.open(os.getcwd(), os.O_TMPFILE | os.O_WRONLY))
attempt("b", lambda: write("b"))
attempt("main.py", lambda: open("main.py", "wb").write(b"x" * 100))  # exists: not created
print(made)
"""
    result = run(code, max_file_mb=1, max_files=3)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == [
        "tmpfile sandbox: O_TMPFILE is not allowed",
        "b sandbox: the program may create at most 3 files and directories",
        "['a', 'dir', 'a again', 'main.py']",
    ]


@pytest.mark.parametrize(
    "attack",
    [
        "import ctypes; ctypes.CDLL(None)",
        "import _ctypes",
        # Loading the C module by its file, or a renamed copy in the sandbox.
        "import glob, importlib.machinery as m, importlib.util as u\n"
        "path = glob.glob(os.path.dirname(math.__file__) + '/_ctypes.*')[0]\n"
        "loader = m.ExtensionFileLoader('_ctypes', path)\n"
        "loader.create_module(u.spec_from_file_location('_ctypes', path, loader=loader))",
        "import glob, shutil, importlib.machinery as m, importlib.util as u\n"
        "path = glob.glob(os.path.dirname(math.__file__) + '/_ctypes.*')[0]\n"
        "shutil.copy(path, 'lib.so')\nloader = m.ExtensionFileLoader('innocent', 'lib.so')\n"
        "loader.create_module(u.spec_from_file_location('innocent', 'lib.so', loader=loader))",
    ],
)
def test_ctypes_cannot_be_loaded(attack):
    assert_refused(run(f"import math, os, sys\n{attack}"), "sandbox:")


@pytest.mark.parametrize(
    "attack",
    [
        "sys.settrace(lambda *args: None)",
        "sys.setprofile(lambda *args: None)",
        "import gc\nhook = [f for f in gc.get_objects() if getattr(f, '__name__', '') == 'audit']\n"
        "hook[0].__defaults__ = None",
        "import gc\nhook = [f for f in gc.get_objects() if getattr(f, '__name__', '') == 'audit']\n"
        "hook[0].__defaults__ = hook[0].__defaults__[:4] + (lambda *args: None,)"
        " + hook[0].__defaults__[5:]",
        "import gc\nhook = [f for f in gc.get_objects() if getattr(f, '__name__', '') == 'check']\n"
        "hook[0].__code__ = (lambda *args: None).__code__",
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
        "import _imp; _imp.create_builtin",
        "import os; os.mknod('node')",
        "(lambda: 0).__code__.replace(co_code=b'')",
        "import os.path; os.path.realpath = lambda p: p; os.getcwd = lambda: '/'\n"
        "open('/etc/passwd').read()",
    ],
)
def test_the_audit_hook_cannot_be_switched_off(attack):
    result = run(f"import sys\n{attack}\nprint(open('/etc/passwd').read())")
    assert_refused(result, "sandbox:", "has no attribute")  # deleted: mknod, create_builtin
    assert "root:" not in result.stdout


def test_the_working_directory_is_removed():
    code = (
        "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
        "os.chmod('a/b', 0)\nos.chmod('a', 0)\nprint(os.getcwd())"
    )
    result = run(code)
    assert result.ok, result.stderr
    workdir = result.stdout.strip()
    assert "jgrpo-sandbox-" in workdir and not os.path.exists(workdir)


def test_run_many_is_not_stalled_by_a_slow_program():
    jobs = ["while True:\n    pass", "print(1)", ("print(input())", "two"), "print(3)"]
    start = time.monotonic()
    results = run_many(jobs, max_workers=2, **LIMITS)
    elapsed = time.monotonic() - start
    assert [r.timed_out for r in results] == [True, False, False, False]
    assert [r.stdout for r in results[1:]] == ["1\n", "two\n", "3\n"]
    assert elapsed < TIMEOUT + 1.5  # about one timeout, not four
    assert run_many([]) == []
