"""Stand-ins for a machine without network, independent of DNS and timing."""

import contextlib
import socket


@contextlib.contextmanager
def refusing_url():
    """An http URL whose port on this machine is bound but not listening: every connection to
    it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"


def forbid_tfds_downloads(monkeypatch):
    """Any TFDS download or preparation fails the test."""
    import tensorflow_datasets as tfds

    def download_and_prepare(*args, **kwargs):
        raise AssertionError("TFDS started a download")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download_and_prepare)
