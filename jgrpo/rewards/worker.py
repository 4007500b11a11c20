"""The reward worker process: runs reward function calls sent by `jgrpo.rewards.pool`.

Started as `python -P worker.py REQUESTS REPLIES` (two pipe file descriptors), so it imports
neither the training script (multiprocessing's spawn and forkserver re-run a script's
`__main__` in every child, which runs an unguarded `train()` again) nor jgrpo itself. It
imports only the standard library until a function's module is unpickled.

Messages are pickles, each sent as an 8-byte length and the bytes:
- parent -> worker: first `sys.path` (the training process's, so the same modules import), then
  per call `(function_pickle, kwargs_pickle)`;
- worker -> parent: `("ready",)` once, then per call `("loaded",)` once the function is
  unpickled (or `("unloadable", message)`), then `("returned", values)` or
  `("raised", message)`.
"""

import os
import pickle
import signal
import struct
import sys
import traceback

_HEADER = struct.Struct("<Q")


def send(fd: int, message) -> None:
    """Writes one message: its length, then its pickle."""
    send_pickle(fd, pickle.dumps(message))


def send_pickle(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("the other end of the pipe closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive(fd: int):
    """Reads one message written by `send`; EOFError when the writer has gone."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, size))


def _error_text() -> str:
    return "".join(traceback.format_exception(*sys.exc_info(), limit=-5)).strip()


def serve(requests: int, replies: int) -> None:
    """Answers calls until the training process closes the request pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process
    sys.path[:] = receive(requests)
    send(replies, ("ready",))
    functions = {}  # function pickle -> the function (its module imported once)
    while True:
        try:
            function_pickle, kwargs_pickle = receive(requests)
        except EOFError:
            return
        try:
            if function_pickle not in functions:
                functions[function_pickle] = pickle.loads(function_pickle)
            function, kwargs = functions[function_pickle], pickle.loads(kwargs_pickle)
        except BaseException:  # noqa: BLE001 (an import error of the user's module, ...)
            send(replies, ("unloadable", _error_text()))
            continue
        send(replies, ("loaded",))
        try:
            values = function(**kwargs)
            # A value that cannot be pickled is the function's error too.
            reply = pickle.dumps(("returned", None if values is None else list(values)))
        except BaseException:  # noqa: BLE001 (whatever a reward function raises, exit included)
            reply = pickle.dumps(("raised", _error_text()))
        send_pickle(replies, reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
