"""The command line of `python -m jgrpo.train` (and the argument split `python -m jgrpo.plan`
shares): the config from YAML and overrides, and one line for each failure a user can fix."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jgrpo import distributed
from jgrpo.checkpoint import CheckpointDamaged
from jgrpo.config import (
    DEMO_OVERRIDES,
    SMOKE_OVERRIDES,
    Config,
    ConfigError,
    demo_config,
    format_help,
    load_config,
)
from jgrpo.lifecycle import RunDirInUse, TrainingDiverged, in_main_thread
from jgrpo.rewards.registry import RewardSpecError
from jgrpo.tasks.datasets import DatasetError
from jgrpo.tools import ToolFormatError

logger = logging.getLogger("jgrpo.train")


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] [key=value ...] -> (config path or None, overrides)."""
    if argv and "=" not in argv[0] and argv[0] != "smoke":
        return argv[0], list(argv[1:])
    return None, list(argv)


def _log_to_stderr() -> None:
    """jgrpo's INFO messages (resume, samples, export) on stderr, whatever else set logging up."""
    log = logging.getLogger("jgrpo")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None, run: Callable[[Config], Any]) -> int:
    """`python -m jgrpo.train`: reads the config, starts the hosts' connection, calls
    `run(config)` (the training loop) and turns each failure it can name into one line on
    stderr and an exit status (2: bad input, 1: the run stopped)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: python -m jgrpo.train [CONFIG.yaml] [section.key=value ...]\n\n"
            "Without CONFIG.yaml the CPU demo runs (a small model learns addition from scratch),\n"
            f"with any overrides on top; the demo sets: {' '.join(DEMO_OVERRIDES)}\n"
            "The word `smoke` among the overrides runs a recipe as a quick CPU check: "
            f"{' '.join(SMOKE_OVERRIDES)}\n"
            "Rerun with the same train.run_dir to resume.\n\nConfig keys:\n" + format_help()
        )
        return 0
    _log_to_stderr()
    path, overrides = parse_args(argv)
    try:  # without a YAML file, the built-in demo with any overrides on top
        config = demo_config(overrides) if path is None else load_config(path, overrides)
    except (ConfigError, FileNotFoundError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    interrupt = signal.getsignal(signal.SIGINT) if in_main_thread() else signal.SIG_IGN
    if interrupt not in (signal.SIG_IGN, None):
        # Ctrl-C ends the process at once: a KeyboardInterrupt would wait for a compilation
        # or a device program to finish. In the loop the first one saves first
        # (`jgrpo.lifecycle.Preemption`).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        d = config.distributed
        distributed.initialize(
            d.initialize,
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes,
            process_id=d.process_id,
        )
        result = run(config)
    except TrainingDiverged as error:
        print(f"training diverged: {error}", file=sys.stderr)
        return 1
    except (RunDirInUse, CheckpointDamaged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    # Found as the hosts connect and the data and the model load (ConnectionError: a data or
    # model source offline; each message names the fix).
    except (
        ConfigError,
        DatasetError,
        ToolFormatError,
        distributed.DistributedError,
        ConnectionError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RewardSpecError as error:
        print(f"error: task.rewards: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
        print(f"error: {_missing_file(error, config)}", file=sys.stderr)
        return 2
    finally:
        if interrupt not in (signal.SIG_IGN, None):
            signal.signal(signal.SIGINT, interrupt)
    if result.stopped_by_signal:
        logger.info("stopped by a signal after step %d; rerun to resume.", result.steps_done)
    return 0


# Config keys that name files or folders the run reads.
_PATH_KEYS = ("task.path", "task.eval_path", "task.data_dir", "model.path", "reward_model.path")


def _missing_file(error: OSError, config: Config) -> str:
    """A file or folder the run could not read, in one line with the config key naming it."""
    if error.filename is None:
        return str(error)  # one of jgrpo's messages, which says what is missing
    missing = str(error.filename)
    keys = []
    for key in _PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value is not None and missing.startswith(str(value)):
            keys.append(f"{key}={value}")
    named = f" (from {', '.join(keys)})" if keys else ""
    return f"{missing}: {error.strerror}{named}; check the path."
