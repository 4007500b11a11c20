"""The run's lifecycle around the steps: the run directory's lock, the compilation cache,
resuming from the newest intact checkpoint, the divergence check before anything is saved,
preemption (SIGTERM, Ctrl-C), profiling, and the export to Hugging Face format."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import socket
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jgrpo import distributed
from jgrpo.checkpoint import Checkpointer
from jgrpo.config import changed_settings
from jgrpo.setup import Setup
from jgrpo.update import TrainState

logger = logging.getLogger("jgrpo.train")


class TrainingDiverged(RuntimeError):
    """The loss, the gradients or the updated weights stopped being finite; nothing was saved
    after that."""


class RunDirInUse(RuntimeError):
    """Another run holds `train.run_dir`: two runs there would interleave their checkpoints
    and metrics."""


def use_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` (`train.compilation_cache`),
    so a later run of the same config reads its compiled programs back instead of compiling.

    A cache the user already chose (JAX_COMPILATION_CACHE_DIR or jax.config) is kept. JAX
    decides whether to use a cache at the process's first compilation, so this is called
    before anything compiles.

    Not on several CPU devices (`--xla_force_host_platform_device_count`): with jaxlib 0.10.2,
    a sharded rollout read back from the cache deadlocked in 5 of 10 runs, its devices
    waiting at two different all-gathers (one inside the prefill's layer loop, one outside
    it that does not depend on it); compiled afresh it never did (docs/troubleshooting.md).
    A cache the user chose is kept there too, with a warning.
    """
    chosen = jax.config.jax_compilation_cache_dir
    cpu_devices = jax.device_count() if jax.default_backend() == "cpu" else 1
    if chosen and cpu_devices > 1:
        logger.warning(
            "The JAX compilation cache %s serves programs on %d CPU devices: XLA:CPU "
            "programs with collectives read back from it can deadlock; if the run hangs, "
            "unset JAX_COMPILATION_CACHE_DIR (docs/troubleshooting.md).",
            chosen,
            cpu_devices,
        )
    if chosen or directory is None:
        return
    if cpu_devices > 1:
        logger.warning(
            "train.compilation_cache is not used on %d CPU devices: XLA:CPU programs with "
            "collectives read back from the cache can deadlock (docs/troubleshooting.md).",
            cpu_devices,
        )
        return
    if "://" not in directory:  # gs:// and other remote paths pass through
        directory = str(pathlib.Path(directory).expanduser())
    jax.config.update("jax_compilation_cache_dir", directory)


def resume(
    setup: Setup, checkpointer: Checkpointer, state: TrainState, ref_params, run_dir
) -> tuple[TrainState, Any, int, int, bool] | None:
    """The newest intact checkpoint of the run, if any: (state, reference, step, data
    position, whether the checkpoint holds a moved reference); None when there is none.

    A reference saved with the checkpoint (one that `algorithm.ref_sync_steps` moved) replaces
    `ref_params`, whether syncing is on now or not. Settings that differ from the
    checkpoint's are named in a warning: they apply from the next step."""
    if checkpointer.latest_step() is None:
        return None
    c, moved = setup.config, None
    setup.check_lora_base(checkpointer.restore_meta())  # adapters need their own base
    state, meta = checkpointer.restore(state)  # the newest intact step, checked
    step, position = int(meta["step"]), int(meta["data_position"])
    if ref_params is not None:  # a moved reference: from its checkpoint, sync on or off
        moved = checkpointer.restore_reference(setup.reference_arguments(), step)
        ref_params = ref_params if moved is None else moved
    setup.load_meta(meta)
    logger.info("resuming %s from step %d", run_dir, step)
    changes = changed_settings(meta.get("config", {}), c)
    if changes:
        logger.warning(
            "resuming with settings other than the checkpoint's (these apply from step %d): %s",
            step + 1,
            "; ".join(changes),
        )
    return state, ref_params, step, position, moved is not None


def non_finite(metrics: Mapping[str, float]) -> str:
    """'name=value' of each divergence sign among the update's metrics ('' if none): a
    non-finite loss or gradient norm (before the update), or a non-finite norm of the
    updated parameters (NaN, or weights past ~1.8e19 whose squares overflow float32)."""
    names = ("loss", "grad_norm", "params_norm")
    return " ".join(
        f"{name}={metrics[name]}" for name in names if not np.isfinite(metrics.get(name, 0.0))
    )


def stop_if_diverged(
    step: int, metrics: Mapping[str, float], last_saved: int | None, checkpoints: pathlib.Path
) -> None:
    """TrainingDiverged when the step's metrics show divergence (`non_finite`): called before
    anything saves the new weights, naming the last good checkpoint."""
    diverged = non_finite(metrics)
    if diverged:
        where = (
            f"the last good checkpoint is step {last_saved} in {checkpoints}"
            " (rerunning resumes from it)"
            if last_saved is not None
            else "no checkpoint was written yet"
        )
        raise TrainingDiverged(
            f"step {step}: {diverged} is not finite; {where}. Lower optim.lr, "
            "keep optim.max_grad_norm set, or use model.dtype=float32."
        )


class Preemption:
    """Turns SIGTERM and a first Ctrl-C (SIGINT) into a flag the loop checks between steps
    (main thread only). The first Ctrl-C puts back the SIGINT handler it replaced, so a second
    one acts as it would without the loop: Python's raises KeyboardInterrupt; the CLI's
    (the system default) ends the process at once. An ignored SIGINT stays ignored."""

    def __init__(self):
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if in_main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
            logger.warning(
                "Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C again: "
                "exit at once, without saving this step)."
            )
        else:
            logger.warning("SIGTERM: saving a checkpoint after this step, then exiting.")
        self.requested = True

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)


@contextlib.contextmanager
def run_dir_lock(run_dir: pathlib.Path):
    """Holds an OS lock (flock) on run_dir/.lock while the run lasts; RunDirInUse when another
    process holds it. The OS drops the lock when its process ends, however it ends (kill -9
    included), so no stale lock ever blocks a resume. Several hosts: process 0 locks for all
    (their shared storage may not pass flock between hosts) and every process learns the
    outcome."""
    import fcntl  # POSIX only

    handle, holder = None, ""
    if distributed.is_primary():
        handle = open(run_dir / ".lock", "a+")  # noqa: SIM115 (held until the run ends)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            handle = None
        else:
            handle.truncate(0)
            handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            handle.flush()
    if distributed.agree_any(distributed.is_primary() and handle is None):
        raise RunDirInUse(
            f"train.run_dir={run_dir} is in use by another run ({holder or 'see process 0'}); "
            "wait for it to end, or give this run another train.run_dir."
        )
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StepProfiler:
    """Traces steps `first` .. `first + count - 1` (counted from 1) with the JAX profiler into
    `directory`, on every process (TensorBoard's profile plugin or XProf open the trace)."""

    def __init__(self, directory: pathlib.Path, first: int, count: int):
        self.directory, self.first, self.last = directory, first, first + count - 1
        self.tracing = False

    def before(self, step: int) -> None:
        if not self.tracing and self.first <= step <= self.last:
            logger.info("tracing steps %d-%d into %s", step, self.last, self.directory)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after(self, step: int) -> None:  # the step's metrics are on the host: it has finished
        if step >= self.last:
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def export(setup: Setup, params, directory: pathlib.Path) -> pathlib.Path:
    """The trained policy as an HF checkpoint (config, safetensors, tokenizer) in `directory`;
    `params` are the trained parameters. With LoRA the checkpoint holds the base with the
    adapters merged in, and `adapter_directory(directory)` the adapters in PEFT's format
    (`peft.PeftModel.from_pretrained(base, that directory)`). Every process calls it (the
    parameters are gathered); the first writes."""
    from jgrpo import models
    from jgrpo.models.lora import save_peft_adapter

    policy = distributed.host_params(setup.merged_params(params))
    adapters = distributed.host_params(params) if setup.lora is not None else None
    if not distributed.is_primary():
        return directory
    setup.model.load_params(policy)
    models.save_pretrained(setup.model, directory)
    if getattr(setup.model, "source_dir", None) is None:
        setup.tokenizer.save_pretrained(directory)
    logger.info("exported the policy to %s", directory)
    if adapters is not None:
        base = setup.config.model.path
        adapter_dir = save_peft_adapter(
            adapter_directory(directory), adapters, setup.model_config, setup.lora, base
        )
        logger.info("exported the LoRA adapters (PEFT format, base %s) to %s", base, adapter_dir)
    return directory


def adapter_directory(directory: pathlib.Path) -> pathlib.Path:
    """Where a LoRA run's export puts its adapters: beside the merged checkpoint, with
    `_adapter` appended to its name (RUN_DIR/hf -> RUN_DIR/hf_adapter)."""
    directory = pathlib.Path(directory)
    return directory.with_name(directory.name + "_adapter")


def export_checkpoint(
    run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, step: int | None = None
) -> pathlib.Path:
    """A checkpoint of `run_dir` in HF format, using the run's config: `step`, or by default
    the newest intact one (a damaged step is skipped with a warning, as a resume does)."""
    from jgrpo.config import from_dict

    with Checkpointer(pathlib.Path(run_dir) / "checkpoints") as checkpointer:
        steps = checkpointer.all_steps()
        if not steps:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to export.")
        meta = checkpointer.restore_meta(steps[-1] if step is None else step)
        setup = Setup(from_dict(meta["config"]))
        setup.check_lora_base(meta)
        state, _ = checkpointer.restore(setup.initial_state(setup.initial_params()), step=step)
    return export(setup, state.params, pathlib.Path(out_dir))
