"""Runs untrusted, model-written Python in a separate, limited process, for code rewards.

Why: a code reward executes whatever the policy wrote, thousands of times per run, on the
training machine. A policy will sooner or later write an infinite loop, a fork bomb, a huge
allocation, or code that deletes or reads files; none of that may stall or damage the run.

What one run does (`run_python`):
- a fresh temporary directory is the child's working directory, deleted afterwards;
- the child is `python -I -S -B` (no user site, no site-packages, no PYTHON* variables, no
  bytecode writes) with a minimal environment, in a new session (process group) that is
  killed as a whole when the wall-clock timeout passes or the program ends;
- before the program runs, the child lowers its resource limits: CPU seconds (about the
  timeout), address space (`memory_mb`), file size (`max_file_mb`), open files, processes;
- then it installs an audit hook (PEP 578; a hook cannot be removed once added) that refuses:
  sockets; fork, exec, spawn, `os.system`, `subprocess`; sending signals; hard and symbolic
  links; writes, deletes, renames and other changes outside the working directory; reads
  outside it except the Python standard library (so imports work); `os.open` with a relative
  path (its audit event does not say which directory `dir_fd` names); loading `ctypes` and
  other C modules that could switch the hook off or touch files behind its back; raising
  resource limits; `sys.settrace`/`sys.setprofile`, new code objects, and changes to the
  hook's own functions (each could rewrite the hook's checks); `gc.get_objects`,
  `gc.get_referrers` and `gc.get_referents` (walking the heap to other functions); a few
  functions that raise no audit event (`os.mknod`, `os.mkfifo`, `os.pidfd_open`,
  `os.chroot`, ...) are deleted;
- the hook also counts the files and directories the program creates (deleted ones too) and
  refuses more than `max_files`, and unnamed `O_TMPFILE` files, so with the file size limit
  the program writes at most `max_files x max_file_mb` to the disk in all (256 MiB at the
  defaults), besides its own source;
- stdout and stderr are read as they come, so a flood of output cannot fill memory: each keeps
  its first and last `max_output_bytes / 2` bytes.

The limits of this sandbox, plainly: it is defence in depth for model-written code on a
training machine, not a security boundary against a determined attacker. CPython's audit hooks
cannot stop code that corrupts the interpreter's memory (crafted bytecode through `marshal`, or
interpreter bugs), C code that opens files without raising an audit event, or a second thread
changing the file system between the hook's check and the system call. Paths are checked
lexically (the program cannot create links; links already in the standard library are read
through). `os.stat` and friends raise no audit event, so the program can learn which files
exist. When the trainer runs as root (as in many containers) the kernel does not enforce
RLIMIT_NPROC, so fork and exec are stopped only by the audit hook, and root's capabilities
(other users' files, raw devices) stay with the child; running the trainer as an unprivileged
user, or in a container or VM of its own, adds the boundary this module does not. For a
non-root user RLIMIT_NPROC is 0, which also stops the program from starting threads. Only the
standard library is importable (`-S`). Linux only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

PROGRAM_NAME = "main.py"
_READ_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one sandboxed program did."""

    ok: bool  # exited with status 0 before the timeout
    returncode: int  # negative: killed by that signal (as in `subprocess`)
    stdout: str  # at most max_output_bytes of it (head and tail) when output_truncated
    stderr: str
    output_truncated: bool  # stdout or stderr was longer than max_output_bytes
    timed_out: bool  # the wall-clock timeout passed; the process group was killed
    killed_reason: str | None  # "timeout", "cpu time limit", "signal SIGSEGV"; None: it exited
    elapsed_s: float  # wall-clock seconds from start to the end of the process group


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    max_file_mb: int = 16,
    max_files: int = 16,
) -> RunResult:
    """Runs `code` as a Python program in a sandboxed child process; see the module docstring.

    The program reads `stdin`, may write files only inside its own temporary working directory
    (at most `max_files` files and directories, each file at most `max_file_mb`), and is killed
    with its whole process group after `timeout_s` wall-clock seconds. `memory_mb` caps its
    address space (allocations beyond raise MemoryError).
    """
    limits = (timeout_s, memory_mb, max_output_bytes, max_file_mb, max_files)
    if min(limits) <= 0:
        raise ValueError(
            "timeout_s, memory_mb, max_output_bytes, max_file_mb and max_files must be > 0"
        )
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="jgrpo-sandbox-"))
    try:
        program = os.path.join(workdir, PROGRAM_NAME)
        with open(program, "w", encoding="utf-8") as file:
            file.write(code.encode("utf-8", "replace").decode("utf-8"))
        argv = [
            sys.executable,
            *("-I", "-S", "-B", "-X", "utf8", "-c", _bootstrap()),
            workdir,
            program,
            str(math.ceil(timeout_s) + 1),  # CPU seconds: a backstop under the wall clock
            str(memory_mb << 20),
            str(max_file_mb << 20),
            str(max_files),
        ]
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        with tempfile.TemporaryFile() as stdin_file:  # a file, so a large stdin cannot block us
            stdin_file.write(stdin.encode("utf-8", "replace"))
            stdin_file.seek(0)
            start = time.monotonic()
            process = subprocess.Popen(
                argv,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                close_fds=True,
                start_new_session=True,  # its own process group, killed as a whole
            )
            with process:
                stdout, stderr, timed_out = _collect(process, start + timeout_s, max_output_bytes)
            elapsed = time.monotonic() - start
    finally:
        _remove_tree(workdir)
    returncode = process.returncode
    if timed_out:
        reason = "timeout"
    elif returncode < 0:
        name = signal.Signals(-returncode).name
        reason = "cpu time limit" if name == "SIGXCPU" else f"signal {name}"
    else:
        reason = None
    return RunResult(
        ok=returncode == 0 and not timed_out,
        returncode=returncode,
        stdout=stdout.text(),
        stderr=stderr.text(),
        output_truncated=stdout.truncated or stderr.truncated,
        timed_out=timed_out,
        killed_reason=reason,
        elapsed_s=elapsed,
    )


def run_many(
    jobs: Sequence[str | tuple[str, str]],
    *,
    max_workers: int = 2,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    max_file_mb: int = 16,
    max_files: int = 16,
) -> list[RunResult]:
    """Runs several programs, `max_workers` at a time; results in the order of `jobs`.

    A job is a program's code, or a (code, stdin) pair. Each program has its own timeout, so
    one that hangs holds one worker for `timeout_s` and the rest of the batch goes on.
    """

    def run(job: str | tuple[str, str]) -> RunResult:
        code, stdin = (job, "") if isinstance(job, str) else job
        return run_python(
            code,
            stdin=stdin,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_output_bytes=max_output_bytes,
            max_file_mb=max_file_mb,
            max_files=max_files,
        )

    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(jobs))) as pool:
        return list(pool.map(run, jobs))


class _Capped:
    """Keeps the first and last `limit / 2` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.head_limit, self.tail_limit = limit // 2, limit - limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        del self.tail[: max(0, len(self.tail) - self.tail_limit)]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        if not self.truncated:
            return head + tail
        cut = self.total - len(self.head) - len(self.tail)
        return f"{head}\n[... {cut} bytes cut by the sandbox ...]\n{tail}"


def _collect(
    process: subprocess.Popen, deadline: float, limit: int
) -> tuple[_Capped, _Capped, bool]:
    """Drains stdout and stderr until both close or the deadline; kills the process group."""
    streams = {process.stdout: _Capped(limit), process.stderr: _Capped(limit)}
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for stream in streams:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready = selector.select(min(remaining, 0.25))
            for key, _ in ready:
                chunk = os.read(key.fd, _READ_CHUNK)
                if chunk:
                    streams[key.fileobj].add(chunk)
                else:
                    selector.unregister(key.fileobj)
            if not ready and process.poll() is not None:
                _kill_group(process.pid)  # the program ended but something still holds a pipe
    if not timed_out:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    _kill_group(process.pid)  # on timeout, and any stray descendant in every case
    process.wait()
    stdout, stderr = streams.values()
    return stdout, stderr, timed_out


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)


def _remove_tree(path: str) -> None:
    """Deletes the working directory, even where the program removed its own permissions."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _bootstrap() -> str:
    """The child's `-c` script: the source of `_child_main`, then a call to it."""
    return textwrap.dedent(inspect.getsource(_child_main)) + "\n_child_main()\n"


def _child_main() -> None:
    """The child: lower the resource limits, install the audit hook, run the program.

    Its source is sent to the child (`_bootstrap`), so it uses no module-level names.
    argv: working directory, program path, CPU seconds, address-space bytes, file-size bytes,
    files and directories the program may create.

    The hook keeps all its state in default arguments holding immutable values and built-in
    functions, and looks up no globals, so the program cannot change what it checks by
    patching modules (`os.path.realpath = ...`) or builtins.
    """
    import builtins
    import itertools
    import os
    import posix
    import resource
    import sys

    workdir, program_path = sys.argv[1], sys.argv[2]
    cpu_s, address_bytes, file_bytes, max_files = (int(value) for value in sys.argv[3:7])

    # Resource limits. RLIMIT_NPROC is per user (processes and threads) and is not enforced
    # for root: there the hook below is what stops fork and exec.
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),  # SIGXCPU at the soft limit, SIGKILL after
        (resource.RLIMIT_AS, (address_bytes, address_bytes)),
        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),  # EFBIG (Python ignores SIGXFSZ)
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_NPROC, (0, 0)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        hard = resource.getrlimit(limit)[1]
        if hard != resource.RLIM_INFINITY:
            value = (min(value[0], hard), min(value[1], hard))
        resource.setrlimit(limit, value)

    with open(program_path, encoding="utf-8") as file:
        source = file.read()

    # Load every built-in module now, then remove the means to create fresh copies of them
    # (`_imp.create_builtin`), so the functions deleted below cannot be brought back. They make
    # device nodes and FIFOs, signal processes by pidfd, or change root or namespaces, and
    # raise no audit event.
    for name in sys.builtin_module_names:
        __import__(name)
    import _imp
    import _signal

    for module, names in (
        (posix, ("mknod", "mkfifo", "pidfd_open", "chroot", "unshare", "setns")),
        (os, ("mknod", "mkfifo", "pidfd_open", "chroot", "unshare", "setns")),
        (_signal, ("pidfd_send_signal",)),
        (_imp, ("create_builtin",)),
    ):
        for name in names:
            if hasattr(module, name):
                delattr(module, name)

    # The hook refuses relative os.open calls (their audit event leaves out dir_fd); without
    # this, shutil.rmtree would use them and fail on nested directories inside the sandbox.
    os.supports_dir_fd.discard(os.open)

    def root(path):
        return os.path.normpath(path).rstrip("/") + "/"

    install = set()  # the standard library (imports), as spelled in sys.path and resolved
    for entry in sys.path:
        if entry:
            install |= {root(entry), root(os.path.realpath(entry))}
    install = tuple(sorted(install))
    sandbox = root(workdir)
    writable = (sandbox, "/dev/null/")
    readable = (*writable, "/dev/urandom/", *install)

    def resolve(path, dir_fd=None, _type=type, _getcwd=posix.getcwd, _readlink=posix.readlink):
        """The absolute, lexically normalised path, or None when it cannot be judged.

        Symbolic links are not followed: the program cannot create any (the hook refuses
        links), and those already in the standard library are only read through.
        """
        if path is None:
            path = "."
        if _type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif _type(path) is int:  # a file descriptor: its path, from /proc
            path = _readlink(f"/proc/self/fd/{path}")
            if not path.startswith("/"):
                return None  # a pipe, socket, ...
        elif _type(path) is not str:
            return None  # path-like objects could answer differently the second time
        if not path.startswith("/"):
            if dir_fd is None or (_type(dir_fd) is int and dir_fd < 0):  # -1: no dir_fd
                base = _getcwd()
            elif _type(dir_fd) is int:
                base = _readlink(f"/proc/self/fd/{dir_fd}")
            else:
                return None
            path = base + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def check(event, path, writing, _writable=writable, _readable=readable, _deny=PermissionError):
        """Raises unless `path` lies under a root it may be written (or read) under."""
        if path is not None:
            roots = _writable if writing else _readable
            for root in roots:
                if (path + "/").startswith(root):
                    return
        action = "write" if writing else "read"
        raise _deny(f"sandbox: {event} may not {action} {path or 'this path'!r}")

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied_events = frozenset(
        {
            *("os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system"),
            *("subprocess.Popen", "os.startfile", "pty.spawn"),
            *("os.kill", "os.killpg", "signal.pthread_kill"),
            *("os.link", "os.symlink"),
            *("resource.setrlimit", "resource.prlimit"),
            # A trace or profile function can rewrite a running hook's local variables.
            *("sys.settrace", "sys.setprofile", "sys.monitoring.register_callback"),
            "code.__new__",  # hand-made bytecode can read and write arbitrary memory
            # Reaching objects by walking the heap: the code rewards' comparison functions.
            *("gc.get_objects", "gc.get_referrers", "gc.get_referents"),
            "fcntl.ioctl",
        }
    )
    denied_prefixes = ("socket.", "ctypes.", "syslog.")
    # C modules that open files or memory without audit events, or switch the hook off.
    denied_modules = frozenset(
        {
            *("_ctypes", "_ctypes_test", "ctypes", "_posixsubprocess", "_xxsubinterpreters"),
            *("_testcapi", "_testinternalcapi", "_testbuffer", "_testclinic", "_testmultiphase"),
            *("_testimportmultiple", "_testsinglephase", "_xxtestfuzz", "_lsprof"),
            *("_sqlite3", "_dbm", "_gdbm", "readline", "_curses", "_curses_panel", "_tkinter"),
            *("_ssl", "spwd", "nis", "ossaudiodev", "_posixshmem", "_multiprocessing"),
            *("posix", "nt", "_imp", "_signal"),  # fresh copies would hold the deleted functions
        }
    )
    # event: (writes?, ((index of the path argument, index of its dir_fd argument or -1), ...))
    path_events = (
        ("os.chdir", True, ((0, -1),)),
        ("os.chflags", True, ((0, -1),)),
        ("os.chmod", True, ((0, 2),)),
        ("os.chown", True, ((0, 3),)),
        ("os.mkdir", True, ((0, 2),)),
        ("os.remove", True, ((0, 1),)),
        ("os.removexattr", True, ((0, -1),)),
        ("os.rename", True, ((0, 2), (1, 3))),
        ("os.rmdir", True, ((0, 1),)),
        ("os.setxattr", True, ((0, -1),)),
        ("os.truncate", True, ((0, -1),)),
        ("os.utime", True, ((0, 3),)),
        ("shutil.rmtree", True, ((0, 1),)),
        ("os.getxattr", False, ((0, -1),)),
        ("os.listxattr", False, ((0, -1),)),
        ("os.listdir", False, ((0, -1),)),
        ("os.scandir", False, ((0, -1),)),
        ("os.fwalk", False, ((0, 4),)),
    )
    path_event_names = frozenset(name for name, _, _ in path_events)
    created = itertools.count()  # files and directories made: only next() changes it

    def audit(
        event,
        args,
        _type=type,
        _len=len,
        _resolve=resolve,
        _check=check,
        _stat=posix.stat,
        _next=next,
        _created=created,
        _max_files=max_files,
        _tmpfile=os.O_TMPFILE,
        _sandbox=sandbox,
        _install=install,
        _write_flags=write_flags,
        _denied_events=denied_events,
        _denied_prefixes=denied_prefixes,
        _denied_modules=denied_modules,
        _path_events=path_events,
        _path_event_names=path_event_names,
        _deny=PermissionError,
        _missing=ModuleNotFoundError,
        _rpartition=str.rpartition,
        _protected=(),  # (audit, resolve, check), filled in below
    ):
        if event == "open":
            path, mode, flags = args
            if _type(path) is int:
                return  # wraps a descriptor that was itself opened through this check
            if mode is None and _type(path) in (str, bytes) and path[:1] not in ("/", b"/"):
                # os.open's event leaves out dir_fd, so a relative path cannot be judged.
                raise _deny("sandbox: os.open needs an absolute path")
            target = _resolve(path)
            writing = bool(flags & _write_flags) or (
                _type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
            )
            _check(event, target, writing)
            if (target + "/").startswith(_sandbox):
                if flags & _tmpfile == _tmpfile:  # unnamed files would escape the count
                    raise _deny("sandbox: O_TMPFILE is not allowed")
                try:
                    kind = _stat(target).st_mode & 0o170000
                except OSError:  # a new file
                    if writing and _next(_created) >= _max_files:
                        raise _deny(
                            f"sandbox: the program may create at most {_max_files} files and "
                            "directories"
                        ) from None
                    return
                if kind not in (0o100000, 0o040000):  # only regular files and directories
                    raise _deny("sandbox: only regular files may be opened")
        elif event == "import":
            name, path = args[0], args[1]
            if _rpartition(name, ".")[2] in _denied_modules:
                raise _missing(f"sandbox: module {name!r} is not available")
            if path is not None:  # an extension module: only from the Python installation
                target = _resolve(path)
                for prefix in _install:
                    if target is not None and (target + "/").startswith(prefix):
                        return
                raise _missing(f"sandbox: extension module {name!r} is not available")
        elif event in _denied_events or event.startswith(_denied_prefixes):
            raise _deny(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" or event == "object.__delattr__":
            for function in _protected:
                if args[0] is function:
                    raise _deny("sandbox: the audit hook's functions may not be changed")
        elif event in _path_event_names:
            for name, writing, slots in _path_events:
                if name == event:
                    for path_index, fd_index in slots:
                        dir_fd = args[fd_index] if 0 <= fd_index < _len(args) else None
                        _check(event, _resolve(args[path_index], dir_fd), writing)
            if event == "os.mkdir" and _next(_created) >= _max_files:
                raise _deny(
                    f"sandbox: the program may create at most {_max_files} files and directories"
                )

    # Positional defaults only: a tuple cannot be changed in place (a __kwdefaults__ dict can).
    audit.__defaults__ = (*audit.__defaults__[:-1], (audit, resolve, check))
    sys.addaudithook(audit)
    del resolve, check, audit

    # Run the program as the __main__ module, with the names `site` would have added.
    import types

    builtins.exit = builtins.quit = sys.exit
    main = types.ModuleType("__main__")
    main.__file__ = program_path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [program_path]
    exec(compile(source, program_path, "exec"), main.__dict__)
