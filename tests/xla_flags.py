"""XLA flags for the test processes and for the processes the tests start.

The suite spends most of its time compiling small programs. These flags make XLA's CPU backend
optimise the code it generates less: about a third less wall time on the compile-heavy files
(test_sharding, test_plan, test_recipes, test_update and test_group_decode: 298 s -> 203 s).
The code computes the same things but may round differently in the last bits than fully
optimised code, so every process of a test that compares runs exactly must use the same
flags: build them with `xla_flags`. Not always only the last bits: on a host with avx512_bf16,
level 0 rounded a bf16 forward's products differently from levels 1 and 2, so
test_group_decode compiles its reference forward at level 2 (`compile(compiler_options)`).
"""

CHEAP_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` host CPU devices (None: XLA's default)."""
    flags = list(CHEAP_COMPILE)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
