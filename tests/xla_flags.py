"""XLA flags for the test processes and for the processes the tests start.

The suite spends most of its time compiling small programs. These flags make XLA's CPU backend
optimise the code it generates less: about a third less wall time on the compile-heavy files
(test_sharding, test_plan, test_recipes, test_update and test_group_decode: 298 s -> 203 s).
The code computes the same things but may round differently in the last bits than fully
optimised code, so every process of a test that compares runs exactly must use the same
flags: build them with `xla_flags`.
"""

CHEAP_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
# The 8 virtual devices of a sharded test are 8 threads on a 2-core machine that another test
# worker also loads: a device reaching a collective (an FSDP all-gather) 40 s after the
# others made XLA abort the process (its default limit; once in CI, on a slow host). Waiting
# longer changes no result, and a real hang still aborts, after 10 minutes.
SLOW_HOST_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` host CPU devices (None: XLA's default)."""
    flags = [*CHEAP_COMPILE, *SLOW_HOST_COLLECTIVES]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
