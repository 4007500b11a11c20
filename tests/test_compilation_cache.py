"""train.compilation_cache: a second run of the same config reads its programs back."""

import logging
import os
import subprocess
import sys

import jax
from xla_flags import xla_flags

RUN = """
import sys
import jax

hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
from jgrpo.config import DEMO_OVERRIDES, load_config
from jgrpo.train import train

run_dir, cache = sys.argv[1:]
overrides = [
    "train.steps=1", "train.eval_every=0", "train.export=false", "train.progress=false",
    "train.tensorboard=false", f"train.run_dir={run_dir}", f"train.compilation_cache={cache}",
]
train(load_config(None, [*DEMO_OVERRIDES, *overrides]))
print("CACHE_HITS", len(hits))
"""


def run_once(run_dir, cache, devices=1) -> tuple[int, str]:
    """Trains the demo config one step in a fresh process on `devices` CPU devices: (how many
    programs it read from the cache, its stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' own cache: this one is the config's
    # Every program is written, whatever it took to compile: with JAX's 1 s threshold, a
    # program near it was skipped by one run and written by the other on a busy machine.
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["XLA_FLAGS"] = xla_flags(devices)
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(run_dir), str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split("CACHE_HITS")[-1]), done.stderr


def test_a_second_run_compiles_nothing_the_first_cached(tmp_path):
    cache = tmp_path / "cache"
    assert run_once(tmp_path / "first", cache)[0] == 0
    cached = sorted(p.name for p in cache.iterdir())
    # At least the rollout and the update.
    assert len(cached) >= 2
    # The second run (a fresh run directory, so not a resume) reads every one of them back
    # and adds nothing: no program it needs was missing.
    assert run_once(tmp_path / "second", cache)[0] == len(cached)
    assert sorted(p.name for p in cache.iterdir()) == cached


def test_several_cpu_devices_run_without_the_cache(tmp_path):
    # Sharded XLA:CPU programs read back from the cache deadlocked in half the runs
    # (docs/troubleshooting.md): on 8 CPU devices the trainer leaves the cache off and says so.
    hits, stderr = run_once(tmp_path / "run", tmp_path / "cache", devices=8)
    assert hits == 0
    assert not (tmp_path / "cache").exists()
    assert "train.compilation_cache is not used on 8 CPU devices" in stderr


def test_a_chosen_cache_on_several_cpu_devices_is_kept_with_a_warning(tmp_path, caplog):
    from jgrpo.train import use_compilation_cache

    chosen = jax.config.jax_compilation_cache_dir  # the suite's own cache (conftest.py)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "chosen"))
    try:
        with caplog.at_level(logging.WARNING, logger="jgrpo.train"):
            use_compilation_cache(str(tmp_path / "configured"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "chosen")
    finally:
        jax.config.update("jax_compilation_cache_dir", chosen)
    assert jax.device_count() == 8
    assert f"{tmp_path / 'chosen'} serves programs on 8 CPU devices" in caplog.text
