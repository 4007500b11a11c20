"""Reward functions in worker processes with a per-call timeout.

A verifier that hangs (a catastrophic regex, a slow parser, a stuck sandbox) would stall the
whole training step. `VerifierPool.run` sends each call to one of a few worker processes and
waits at most `timeout_s`; on timeout that worker is killed (a spare takes the next call
while a new one starts) and the call raises `VerifierTimeout`. A worker that dies during a
call (`os._exit`, a crash, the out-of-memory killer) is noticed at once and the call raises
`WorkerDied`. `score_completions` handles both like any other exception.

The workers are plain `python -P jgrpo/rewards/worker.py` processes, not multiprocessing's:
spawn and forkserver children re-run the training script's `__main__` to rebuild it, and a
script without an `if __name__ == "__main__":` guard (the README's example, a TRL script)
would then start training again in every worker. A worker imports only the modules of the
functions it is sent, with the training process's `sys.path`. So:

- functions defined in `__main__` (a script, stdin, `python -c`, a notebook), lambdas and
  closures cannot go to a worker: they run here, in a thread that is abandoned when it
  outlasts the timeout (the call then raises `VerifierTimeout`; C code that holds the GIL,
  such as a catastrophic regex, cannot be interrupted this way). A one-time log line says so;
  put the function in a module of its own (`my_rewards.py`) to run it in a worker;
- a worker that cannot start, or cannot import a function's module, is a `RewardError` at
  once (its traceback is logged), never a silent restart loop.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.connection
import os
import pathlib
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from jgrpo.rewards import worker as protocol
from jgrpo.rewards.scoring import RewardError

logger = logging.getLogger("jgrpo.rewards")

_WORKER_FILE = str(pathlib.Path(protocol.__file__).resolve())
_NO_WORKERS = "or set task.reward_workers=0 to score rewards in the training process"


class VerifierTimeout(TimeoutError):
    """A reward function call took longer than the pool's timeout."""


class WorkerDied(RuntimeError):
    """The worker process running a reward function call exited before it answered."""


class WorkerCallError(RuntimeError):
    """A reward function raised in a worker process; the message holds its traceback."""


class _NotForWorkers(pickle.PicklingError):
    """The call refers to `__main__`, which a worker cannot import."""


class _WorkerPickler(pickle.Pickler):
    """Pickles what a worker can load. A worker imports a function's module by name, and
    `__main__` (a script, stdin, `python -c`, a notebook) cannot be imported without running
    it again, so anything defined there is refused."""

    def reducer_override(self, obj):
        if getattr(obj, "__module__", None) == "__main__":
            raise _NotForWorkers(f"{obj!r} is defined in __main__")
        return NotImplemented


def _worker_pickle(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _WorkerPickler(buffer).dump(obj)
    return buffer.getvalue()


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self):
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", _WORKER_FILE, str(requests_read), str(replies_write)],
                pass_fds=(requests_read, replies_write),
                stdin=subprocess.DEVNULL,
            )
        except OSError as error:
            os.close(self.requests)
            os.close(self.replies)
            raise RewardError(
                f"cannot start a reward worker process ({error}); {_NO_WORKERS}."
            ) from error
        finally:  # the worker's ends: closed here, so its exit reads as end of file
            os.close(requests_read)
            os.close(replies_write)
        self.ready = False  # it has answered the first message
        with contextlib.suppress(BrokenPipeError):  # it exited at once: receive() says so
            protocol.send(self.requests, sys.path)

    def send(self, message: Any) -> None:
        """Raises WorkerDied when the worker has exited."""
        try:
            protocol.send(self.requests, message)
        except BrokenPipeError:
            raise WorkerDied(f"exited with code {self.process.wait()}") from None

    def receive(self, timeout_s: float) -> tuple | None:
        """The worker's next message; None after `timeout_s`; WorkerDied when it exited."""
        if not multiprocessing.connection.wait([self.replies], timeout_s):
            return None
        try:
            return protocol.receive(self.replies)
        except EOFError:
            raise WorkerDied(f"exited with code {self.process.wait()}") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for fd in (self.requests, self.replies):
            os.close(fd)


class VerifierPool:
    """`workers` processes (started on first use) that run reward calls with a timeout."""

    def __init__(self, workers: int = 2, timeout_s: float = 60.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}.")
        self.workers, self.timeout_s = workers, timeout_s
        # Starting a worker and importing a function's module (jax, a parser, ...) can take
        # seconds on a busy machine: it has its own, longer limit.
        self.load_limit_s = max(60.0, 10 * timeout_s)
        self._workers: list[_Worker] = []  # the first takes the calls, the others are spares
        self._logged: set[str] = set()  # names already logged as running here

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any], *, name: str = "") -> Any:
        """fn(**kwargs) in a worker, or here when it cannot go to one, in at most timeout_s."""
        try:
            call = (_worker_pickle(fn), _worker_pickle(kwargs))
        except _NotForWorkers:
            why = (
                "is defined in __main__ (a script, stdin, -c, a notebook): no worker can import it"
            )
            return self._run_here(fn, kwargs, name, why)
        except Exception:  # noqa: BLE001 (whatever pickling raises: run it here instead)
            return self._run_here(
                fn, kwargs, name, "cannot be pickled (a lambda, a closure or a nested function)"
            )
        worker = self._ready_worker()
        try:
            worker.send(call)
            loaded = worker.receive(self.load_limit_s)
            if loaded is not None and loaded[0] == "loaded":
                reply = worker.receive(self.timeout_s)
        except WorkerDied as died:
            self._discard(worker)
            raise WorkerDied(
                f"the worker process running reward function {name!r} {died} before it "
                "answered (os._exit, a crash or out of memory)"
            ) from None
        if loaded is None or loaded[0] == "unloadable":
            self._discard(worker)
            if loaded is None:
                raise RewardError(
                    f"reward function {name!r} was not loaded in a worker process within "
                    f"{self.load_limit_s:g} s (importing its module hangs); fix the module, "
                    f"{_NO_WORKERS}."
                )
            logger.error("reward function %r cannot be loaded in a worker:\n%s", name, loaded[1])
            raise RewardError(
                f"reward function {name!r} cannot be loaded in a reward worker process "
                f"({loaded[1].splitlines()[-1]}); make its module importable from the "
                f"training process's sys.path, {_NO_WORKERS}."
            )
        if reply is None:
            self._discard(worker)  # a stuck call cannot be interrupted: kill its worker
            raise VerifierTimeout(
                f"reward function {name!r} took longer than {self.timeout_s:g} s "
                "(task.reward_timeout_s)"
            )
        if reply[0] == "raised":
            raise WorkerCallError(f"in a worker process:\n{reply[1]}")
        return reply[1]

    def _ready_worker(self) -> _Worker:
        """The worker that takes the next call, with spares starting beside it."""
        for exited in [w for w in self._workers if w.process.poll() is not None]:
            self._discard(exited)
        while len(self._workers) < self.workers:
            self._workers.append(_Worker())
        worker = self._workers[0]
        if not worker.ready:
            try:
                reply = worker.receive(self.load_limit_s)
            except WorkerDied as died:
                self._discard(worker)
                raise RewardError(
                    f"a reward worker process {died} at start (its error is above); {_NO_WORKERS}."
                ) from None
            if reply is None:
                self._discard(worker)
                raise RewardError(
                    f"a reward worker process did not start within {self.load_limit_s:g} s; "
                    f"{_NO_WORKERS}."
                )
            worker.ready = True
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.close()
        self._workers.remove(worker)

    def _run_here(self, fn: Callable[..., Any], kwargs: dict[str, Any], name: str, why: str):
        """fn(**kwargs) in a thread of this process, abandoned after timeout_s."""
        if name not in self._logged:
            self._logged.add(name)
            logger.info(
                "reward function %r %s: it runs in the training process (with the timeout, "
                "without a process of its own); define it in a module of its own, such as "
                "my_rewards.py, to run it in a worker process",
                name,
                why,
            )
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["values"] = fn(**kwargs)
            except BaseException as error:  # noqa: BLE001 (raised again in the caller)
                outcome["error"] = error

        thread = threading.Thread(target=call, name=f"reward {name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise VerifierTimeout(
                f"reward function {name!r} took longer than {self.timeout_s:g} s "
                "(task.reward_timeout_s); it runs in the training process, where it cannot be "
                "stopped: its thread is left running"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["values"]

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self._workers = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
