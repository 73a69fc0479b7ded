"""The environment a worker process gets from marind: every ``MARIND_*`` name in one place.

The agent (``marind.agent.supervisor``) sets these for each torchrun it starts; torchrun
adds its own (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...). Workers,
the zygote and the trainer read them through :class:`WorkerEnv` or the names below, never
by spelling a string of their own. The agent's *own* settings (``MARIND_ETCD``,
``MARIND_STATE_DIR``, ...) are read in ``marind.control.config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: The job's run directory on this node (progress records, logs, the stored run.toml).
RUN_DIR = "MARIND_RUN_DIR"
#: The stored run.toml of the job on this node (``$MARIND_RUN_DIR/run.toml``): every section,
#: the program's own included, with paths made absolute at submit
#: (``marind.worker.job_store`` reads ``[checkpoint]`` from it).
RUN_TOML = "MARIND_RUN_TOML"
#: ``[job] working_dir``: the workers' current directory (the launcher changes into it).
WORKING_DIR = "MARIND_WORKING_DIR"
#: The job's name, for log context and torchft's replica ids.
JOB_ID = "MARIND_JOB_ID"
#: The node name of the agent that started this worker.
NODE = "MARIND_NODE"
#: etcd credentials handed down by the agent (never on a command line).
ETCD_USER = "MARIND_ETCD_USER"
ETCD_PASSWORD = "MARIND_ETCD_PASSWORD"
#: torchft mode: this node's replica-group slot, 0..replica_groups-1.
REPLICA_GROUP = "MARIND_REPLICA_GROUP"
#: torchft's own variable: the lighthouse's address when the worker starts.
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
#: Warm starts (``marind.agent.warm_start.zygote``): the fork server's abstract socket, the file in which it
#: records forked pids, the modules it preloads (``[job] preload``, comma-separated), and how
#: long a stub waits for it.
ZYGOTE_SOCKET = "MARIND_ZYGOTE_SOCKET"
ZYGOTE_PIDS = "MARIND_ZYGOTE_PIDS"
ZYGOTE_PRELOAD = "MARIND_ZYGOTE_PRELOAD"
ZYGOTE_WAIT = "MARIND_ZYGOTE_WAIT"
ZYGOTE_PREFIX = "MARIND_ZYGOTE_"
#: Peak dense FLOP/s of one rank's device, for MFU when the device is not in the table.
PEAK_FLOPS = "MARIND_PEAK_FLOPS"
#: Benchmarks: time each pipeline rank's stages from step N+1 on (``marind.trainer.parallel.pipeline_timing``);
#: unset, off.
BENCH_PP_TIMING = "MARIND_BENCH_PP_TIMING"
#: Logging: level name, and JSON lines (``1``) or console output (``0``).
LOG_LEVEL = "MARIND_LOG_LEVEL"
LOG_JSON = "MARIND_LOG_JSON"
#: Test hooks honoured by the reference trainer and the test workers.
TEST_STOP_AT_STEP = "MARIND_TEST_STOP_AT_STEP"
TEST_NAN_AT_STEP = "MARIND_TEST_NAN_AT_STEP"
TEST_STEP_SLEEP = "MARIND_TEST_STEP_SLEEP"
TEST_HANG_AT_STEP = "MARIND_TEST_HANG_AT_STEP"
#: torchft mode: a file's path; while it exists, each rank waits before its cross-group all-reduce.
TEST_FT_PAUSE_FILE = "MARIND_TEST_FT_PAUSE_FILE"


def _int_or_none(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} = {value!r} must be an integer") from None


@dataclass(frozen=True)
class WorkerEnv:
    """What marind told this worker, read once from the environment."""

    run_dir: Path | None
    job_id: str | None
    node: str | None
    replica_group: int | None
    test_stop_at_step: int
    test_nan_at_steps: tuple[int, ...]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the worker's variables.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: a variable that must be an integer is not one.
        """
        env = os.environ if environ is None else environ
        nan = env.get(TEST_NAN_AT_STEP, "")
        try:
            nan_steps = tuple(int(s) for s in nan.split(",") if s.strip())
        except ValueError:
            raise ValueError(f"{TEST_NAN_AT_STEP} = {nan!r} must be integers separated by commas") from None
        return cls(
            run_dir=Path(env[RUN_DIR]) if env.get(RUN_DIR) else None,
            job_id=env.get(JOB_ID) or None,
            node=env.get(NODE) or None,
            replica_group=_int_or_none(env, REPLICA_GROUP),
            test_stop_at_step=_int_or_none(env, TEST_STOP_AT_STEP) or 0,
            test_nan_at_steps=nan_steps,
        )
