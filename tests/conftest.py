"""Forces 8 host CPU devices before JAX initialises, so sharding tests run on any machine."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import jax  # noqa: E402  (must come after XLA_FLAGS is set)

jax.config.update("jax_num_cpu_devices", 8)
