"""Reward functions in worker processes with a per-call timeout.

A verifier that hangs (a catastrophic regex, a slow parser, a stuck sandbox) would stall the
whole training step. `VerifierPool.run` sends each call to a process of a small pool
(forkserver: the training process's threads are never forked) and waits at most
`timeout_s`; on timeout the pool is killed and restarted, and the call raises
`VerifierTimeout`, which `score_completions` handles like any other failure (the rows are
retried one by one, and those that fail again are scored None).

Only picklable functions can go to a worker: module-level functions and
`functools.partial` of them. Anything else (a lambda, a closure) runs in the training
process, without the timeout.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import pickle
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("jgrpo.rewards")


class VerifierTimeout(TimeoutError):
    """A reward function call took longer than the pool's timeout."""


class _WorkerPickler(pickle.Pickler):
    """Pickles what a worker can load. A worker imports a function's module by name, so
    anything defined in an interactive `__main__` (a notebook cell, `python -c`), which has no
    file to import, is refused: it runs in the training process instead of hanging the pool."""

    def reducer_override(self, obj):
        if getattr(obj, "__module__", None) == "__main__" and _interactive_main():
            raise pickle.PicklingError(f"{obj!r} is defined in an interactive __main__")
        return NotImplemented


def _interactive_main() -> bool:
    return getattr(sys.modules.get("__main__"), "__file__", None) is None


def _invoke(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[Any]:
    return list(fn(**kwargs))


def _load(fn: Callable[..., Any]) -> None:
    """Nothing: receiving `fn` makes the worker import its module, outside any timeout."""


class VerifierPool:
    """`workers` processes (started on first use) that run reward calls with a timeout."""

    def __init__(self, workers: int = 2, timeout_s: float = 60.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}.")
        self.workers, self.timeout_s = workers, timeout_s
        self._pool = None
        self._loaded: set[bytes] = set()  # functions whose modules the current workers import
        self._in_process: set[str] = set()  # names already logged as not picklable

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any], *, name: str = "") -> Any:
        """fn(**kwargs) in a worker (at most timeout_s seconds), or here when not picklable."""
        try:
            _WorkerPickler(io.BytesIO()).dump((fn, kwargs))
        except Exception:  # noqa: BLE001 (whatever pickling raises, run it here instead)
            if name not in self._in_process:
                self._in_process.add(name)
                logger.info(
                    "reward function %r cannot go to a worker (not picklable, or defined in a "
                    "notebook): it runs in-process",
                    name,
                )
            return fn(**kwargs)
        if self._pool is None:
            self._pool = multiprocessing.get_context("forkserver").Pool(self.workers)
            self._loaded = set()
        self._load_in_workers(fn, name)
        pending = self._pool.apply_async(_invoke, (fn, kwargs))
        try:
            return pending.get(self.timeout_s)
        except multiprocessing.TimeoutError:
            self._kill()  # the stuck worker cannot be interrupted: restart the pool
            raise VerifierTimeout(
                f"reward function {name!r} took longer than {self.timeout_s} s "
                "(task.reward_timeout_s)"
            ) from None

    def _load_in_workers(self, fn: Callable[..., Any], name: str) -> None:
        """Starting a worker and importing a verifier's module (jax, a parser, ...) can take
        seconds on a busy machine; done once per pool start, it does not count against the
        timeout of a call."""
        blob = pickle.dumps(fn)
        if blob in self._loaded:
            return
        limit = max(60.0, 10 * self.timeout_s)
        try:
            self._pool.map_async(_load, [fn] * self.workers, chunksize=1).get(limit)
        except multiprocessing.TimeoutError:
            self._kill()
            raise VerifierTimeout(
                f"reward function {name!r} could not be loaded in a worker within {limit} s"
            ) from None
        self._loaded.add(blob)

    def _kill(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def close(self) -> None:
        self._kill()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
