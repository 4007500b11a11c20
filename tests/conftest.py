"""Forces 8 host CPU devices before JAX initialises, so sharding tests run on any machine, makes
compilation cheaper (`xla_flags.py`), and shares compiled programs between the tests of one
session.

Many tests compile the same small programs (in this process and in the `python -m jgrpo.train`
processes they start); a persistent compilation cache in a fresh directory per session, which
the child processes inherit, compiles each once. Under `pytest -n 2` (pytest-xdist) this file
runs first in the controlling process, so both workers inherit its flags and share its cache.
`count_compiles` counts cache hits as compilations, so a recompile is still seen.

Sharded CPU programs read back from the cache can deadlock (docs/troubleshooting.md; seen in
test_compilation_cache's demo rollout, which therefore runs on one device). The cache stays:
it saves a fifth of the compile-heavy files' time (test_sharding, test_train and test_plan
under -n 2: 334 s -> 277 s), and a whole run reads only 12 sharded programs back (counted on
2026-12-03: small helpers, one train_step and one init_state, all in the pytest workers, none
in the training processes tests start), none of which has hung in CI.
"""

import atexit
import os
import shutil
import tempfile

from xla_flags import xla_flags

if xla_flags(8) not in os.environ.get("XLA_FLAGS", ""):  # xdist workers inherit them
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), xla_flags(8)]).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jgrpo-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import jax  # noqa: E402  (must come after XLA_FLAGS is set)

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> (directory of a tiny saved HF checkpoint with a tokenizer, its torch model)."""
    from tiny_hf import save_checkpoint

    made = {}

    def make(family):
        if family not in made:
            directory = tmp_path_factory.mktemp(family)
            made[family] = directory, save_checkpoint(family, directory, with_tokenizer=True)
        return made[family]

    return make


_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: (
        _compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
)
jax.monitoring.register_event_listener(  # a program found in the persistent cache
    lambda event, **kwargs: (
        _compiles.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
)


@pytest.fixture
def count_compiles():
    """Returns a function giving the number of XLA compilations since the test started."""
    start = len(_compiles)
    return lambda: len(_compiles) - start


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops each test file's compiled programs when it ends. One process holding every
    program of the suite crashed late in the run (segfaults inside XLA's compile and load,
    at varying tests), which points at a per-process limit such as mapped regions
    (vm.max_map_count 65530 here); the persistent cache still shares programs."""
    yield
    from jgrpo import train

    train._PROGRAMS.clear()
    jax.clear_caches()


@pytest.fixture(scope="session", autouse=True)
def _children_start_with_the_cli_tunables():
    """The processes a test starts inherit the glibc tunables that `python -m jgrpo.train` and
    the benchmark scripts re-execute themselves with (`jgrpo.huge_pages`), so they run as a
    user's do without a second interpreter start and import (about 2 s each, measured with
    `python -m jgrpo.train --help`: 4.3 s against 2.3 s). A session fixture runs in the
    pytest workers only, after they started: their own malloc keeps glibc's defaults."""
    from jgrpo.huge_pages import local_huge_page_environment

    environ = local_huge_page_environment(os.environ)
    if environ is not None:
        os.environ["GLIBC_TUNABLES"] = environ["GLIBC_TUNABLES"]
