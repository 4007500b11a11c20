"""Forces 8 host CPU devices before JAX initialises, so sharding tests run on any machine."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

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


@pytest.fixture
def count_compiles():
    """Returns a function giving the number of XLA compilations since the test started."""
    start = len(_compiles)
    return lambda: len(_compiles) - start
