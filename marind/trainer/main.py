"""Entry point: ``python -m marind.trainer run.toml`` (under torchrun, or alone as one process).

Parse the spec, install SIGUSR1 stack dumps (the agent's hang probe) and
the SIGTERM/SIGINT stop flag, join the process group, train, shut down
cleanly. Exit 0 when done, 143 after a requested stop (clean), 2 for a
bad spec, 1 for anything else.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

from marind.core.errors import SpecError
from marind.core.log import get_logger
from marind.core.netutil import free_port
from marind.trainer.config import TrainerSpec, load_trainer_spec

USAGE = "usage: python -m marind.trainer RUN.toml|SPEC.json  (under torchrun, or alone)"


def read_spec(path: str) -> TrainerSpec:
    """The run's spec from a run.toml, or from the JSON the agent stores (``.json``).

    Args:
        path: the file.

    Returns:
        The spec, not yet checked against a world size.

    Raises:
        SpecError: the spec is invalid.
        OSError: the file cannot be read.
        ValueError: the JSON is malformed.
    """
    return load_trainer_spec(path, check_worlds=False)


def _standalone_env() -> None:
    """One process without torchrun: a world of 1 on loopback."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def main(argv: list[str] | None = None) -> int:
    """Run the reference trainer on one rank (under torchrun, or alone as a world of one).

    Args:
        argv: ``[RUN.toml|SPEC.json]``; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 done, 143 (``STOP_EXIT_CODE``) stopped on request, 2 bad usage or spec.

    Raises:
        Exception: whatever training raised (logged as ``train_failed`` first; the exit code is 1).
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        return 2
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log = get_logger("trainer")
    try:
        spec = read_spec(argv[0])
    except (SpecError, OSError, ValueError) as exc:
        sys.stderr.write(f"Error: {str(exc).splitlines()[0]}\n")
        return 2

    from marind.distributed import init_distributed, shutdown_distributed
    from marind.trainer.config import validate_for_world
    from marind.trainer.loop import STOP_EXIT_CODE
    from marind.trainer.train import train
    from marind.worker.stop import stop_flag

    stop = stop_flag()   # the process's flag, the one marind.worker.should_stop() reads
    stop.install()
    _standalone_env()
    try:
        validate_for_world(spec, int(os.environ["WORLD_SIZE"]))
    except SpecError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 2
    device = init_distributed()
    code = 1
    try:
        if spec.fault.mode == "torchft":
            from marind.trainer.ft.train import train_ft as train
        result, _, _ = train(spec, device, stop=stop)
        code = STOP_EXIT_CODE if result.stopped else 0
    except SpecError as exc:      # found only on the hosts (checkpoint.memory_every's memory): refused
        sys.stderr.write(f"Error: {exc}\n")
        log.error("train_refused", error=str(exc))
        return 2
    except Exception as exc:
        log.error("train_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
        raise
    finally:
        if code in (0, STOP_EXIT_CODE):
            shutdown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
