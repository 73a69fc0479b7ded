"""examples/slurm/marind.sbatch under a real Slurm on the multi-host bed.

Each host of the bed runs a slurmd (its own ``NodeName``, the host's hostname); slurmctld and
munged run on the bridge side (``marind.testing.slurm_bed``). The script is ``sbatch``-ed from
host1 as a user would: one ``marind agent`` per allocated node through ``srun``, the embedded
etcd on the first node, the run submitted with the allocation's node range and followed to its
end; the checkpoints are files (every host sees the same filesystem).

* CI: two hosts, the real trainer, host2 powered off mid-run: the run goes on with host1, Slurm marks
  host2 DOWN and reports the job COMPLETED, the run SUCCEEDED, every checkpoint verifies and the history
  holds.
* ``slow`` (``make chaos``): a run whose program fails is a FAILED Slurm job with the script's exit
  code 4, not requeued; three hosts, a host other than the first powered off for good in the
  middle of the run: marind goes on with two, Slurm marks the host DOWN (and drained, the script
  telling it: ``MARIND_SLURM_DRAIN=1``), the job still ends COMPLETED; and a job whose etcd never
  answers is requeued once by the script, then FAILED with exit code 3.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from ckpt_store import CheckpointStore
from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.testing.chaos import host_faults
from marind.testing.hosts import AGENT_ENV, HostBed
from marind.testing.procs import REPO_ROOT
from marind.testing.slurm_bed import SlurmBed, slurm_unavailable
from tests.agent.helpers import wait_for
from tests.chaos.test_scenarios import EVERY, Cluster, _check_checkpoints, _spec
from tests.hosts.conftest import require_bed

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(1500)]

log = get_logger("tests.host_slurm")
SCRIPT = REPO_ROOT / "examples" / "slurm" / "marind.sbatch"
ETCD_PORT = 23790          # the embedded etcd's port on the first node (MARIND_SLURM_ETCD_PORT)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from marind.trainer.data import corpus
    prefix = tmp_path_factory.mktemp("slurm-data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


@pytest.fixture
def slurm(request, tmp_path):
    """A bed of ``request.param = (hostnames, site_etcd)`` and Slurm on it; without ``site_etcd`` the bed has
    no etcd (the job brings its own)."""
    require_bed()
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    names, site_etcd = getattr(request, "param", (("host1", "host2"), False))
    bed = HostBed(tmp_path / "bed", list(names), etcd=site_etcd).start()
    cluster = None
    try:
        cluster = SlurmBed(bed, tmp_path / "slurm").start()
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        bed.close()
    assert cluster.leftovers() == [] and bed.leftovers() == []


class SlurmRun(Cluster):
    """One sbatch of the example script, seen through Slurm and through the run's own etcd.

    The ``Cluster`` helpers of test_scenarios (steps, events, losses, restarts) read the job's keys
    and the agents' state dirs (``bed.root/state-NODE``, as ``MARIND_SLURM_STATE_DIR`` puts them).
    """

    def __init__(self, slurm: SlurmBed, spec: Path, url: str, *, env: dict | None = None):
        self.slurm, self.bed = slurm, slurm.bed
        self.tmp, self.nodes, self.data = self.bed.root, tuple(self.bed.names), ""
        self.url = url
        self.etcd: LocalEtcd | None = None
        base_prefix = f"/marind-slurm-test-{uuid.uuid4().hex[:8]}"
        self.slurm_job = slurm.sbatch("host1", [f"--nodes={len(self.nodes)}",
                                                f"--output={self.tmp}/slurm-%j.out", str(SCRIPT), str(spec)],
                                      env={"PATH": f"{Path(REPO_ROOT) / '.venv' / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
                                           "MARIND_ETCD": "", "MARIND_PREFIX": base_prefix,
                                           "MARIND_SLURM_STATE_DIR": str(self.tmp),
                                           "MARIND_SLURM_ETCD_PORT": str(ETCD_PORT),
                                           "MARIND_SLURM_METRICS_PORT": "-1", **AGENT_ENV, **(env or {})})
        self.prefix = f"{base_prefix}/slurm/{self.slurm_job}.0"
        self.job = f"slurm-{self.slurm_job}.0"
        self.jobs = {url: self.job}                        # _check_checkpoints runs the history checker on it
        site = (env or {}).get("MARIND_ETCD")
        self.client = EtcdClient(site or f"http://{self.bed.addr('host1', 'control')}:{ETCD_PORT}", prefix=self.prefix)

    def store(self, url: str) -> CheckpointStore:
        return CheckpointStore(url)

    def output(self) -> str:
        try:
            return (self.tmp / f"slurm-{self.slurm_job}.out").read_text(errors="replace")
        except OSError:
            return ""

    def diag(self) -> str:
        agents = "\n".join(f"--- agent {n} ---\n{self._tail(self.tmp / f'state-{n}' / 'agent.log')}"
                           for n in self.nodes)
        return (f"--- scontrol show job ---\n{self.slurm.job(self.slurm_job)}\n--- sinfo ---\n"
                f"{self.slurm.node_states()}\n--- slurm-{self.slurm_job}.out ---\n{self.output()[-4000:]}\n"
                f"{agents}\n--- slurmctld.log ---\n{self.slurm.log_tail('slurmctld.log')}")

    @staticmethod
    def _tail(path: Path, chars: int = 3000) -> str:
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(none)"

    def safely(self, read, default=None):
        """``read()``, or ``default`` while the run's etcd is not up (before the script started it)."""
        try:
            return read()
        except Exception:  # noqa: BLE001 - etcd not there yet; the caller's wait_for retries
            return default

    def wait_slurm(self, timeout: float = 900) -> dict[str, str]:
        try:
            return self.slurm.wait_job(self.slurm_job, timeout=timeout)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.diag()}") from None

    def reopen_etcd(self) -> None:
        """Read the run's keys after the job: the embedded etcd went with it, its data stayed in
        ``STATE_DIR/etcd.0/data``; a member started here on that data holds every key as the job left it."""
        self.client.close()
        self.etcd = LocalEtcd(self.tmp / "etcd.0" / "data", name="marind").start()
        self.client = EtcdClient(self.etcd.endpoint, prefix=self.prefix)

    def close(self) -> None:
        self.client.close()
        if self.etcd is not None:
            self.etcd.stop()


def _start(slurm: SlurmBed, dataset: str, steps: int, env: dict | None = None) -> SlurmRun:
    tmp = slurm.bed.root
    url = f"file://{tmp}/ckpt"
    spec = Path(_spec(tmp, "slurm-train", dataset, url, None, "1", hang_timeout="300s", steps=steps,
                      global_batch=24 if len(slurm.bed.names) == 3 else 8))
    run = SlurmRun(slurm, spec, url, env=env)
    log.info("sbatched", slurm_job=run.slurm_job, run=run.job)
    return run


# -- CI: the script end to end on two hosts, the second powered off -------------------------------------

def test_sbatch_runs_on_every_allocated_node_and_completes_without_a_host_powered_off(slurm, dataset):
    """Two hosts, ``job.nodes`` from the allocation (``1:2``); host2 (not the first: it runs neither the script nor
    etcd) powered off past the first checkpoint: marind goes on with host1's two ranks, Slurm marks host2 DOWN and
    keeps the job (``--no-kill``), and the job still ends COMPLETED with every step trained once."""
    steps = 24
    run = _start(slurm, dataset, steps)
    try:
        wait_for(lambda: run.safely(lambda: run.world_size(run.job) == 4 and run.step(run.job) >= EVERY + 1),
                 600, "the run training on both hosts (4 ranks) past its first checkpoint", interval=0.5,
                 diag=run.diag)
        out = run.output()
        assert "event=agents_registered count=2" in out, out
        frozen = slurm.bed.power_off("host2")
        assert frozen, "nothing ran in host2"
        host_faults.kill_host_processes(slurm.bed.host("host2"))
        lost_at = run.step(run.job)
        wait_for(lambda: run.world_size(run.job) == 2 and run.step(run.job) > lost_at, 600,
                 "host1 training alone", interval=0.5, diag=run.diag)
        wait_for(lambda: _down_or_drained(slurm, "host2"), 300, "Slurm marking host2 down", interval=1,
                 diag=run.diag)
        rec = run.wait_slurm()
        assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", run.diag()
        out = run.output()
        assert "exit_code=0" in out and " succeeded " in out, out             # the run's events, followed
        assert "event=node_lost node=host2" in out, out
        run.reopen_etcd()
        assert run.client.get_json(run.client.key("jobs", run.job, "state"))["state"] == "SUCCEEDED"
        spec = run.client.get_json(run.client.key("jobs", run.job, "spec"))
        assert spec["job"]["nodes"] == "1:2", spec["job"]            # the allocation's range, not the run.toml's
        _check_checkpoints(run, run.url, steps)
        lost = [e for e in run.events(run.job) if e["kind"] == "node_lost"]
        assert [e["detail"]["node"] for e in lost] == ["host2"], run.events(run.job)
        assert sorted(run.losses(run.job)) == list(range(1, steps + 1))
        assert slurm.node_states()["host1"] == "idle", slurm.node_states()
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.parametrize("slurm", [(("host1", "host2"), True)], indirect=True)
def test_a_failed_run_on_the_sites_etcd_is_a_failed_slurm_job_not_requeued(slurm):
    """The program exits 1 at once with no restarts left: marind's run FAILED, the script exits 4. etcd is
    the site's (the bed's, on the bridge side: ``MARIND_ETCD``), which keeps the run's keys after the job."""
    spec = slurm.bed.root / "fails.toml"
    spec.write_text('[job]\nname = "fails"\nnodes = "1"\nnproc_per_node = 1\nmax_restarts = 0\n'
                    'command = ["python", "-c", "import sys; sys.exit(1)"]\n')
    run = SlurmRun(slurm, spec, "", env={"MARIND_ETCD": slurm.bed.plan.etcd})
    try:
        rec = run.wait_slurm(timeout=600)
        assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "4:0", run.diag()
        assert rec.get("Restarts") == "0", rec                              # auto requeues only 3 and 5
        out = run.output()
        assert "mode=site" in out and "exit_code=4" in out and "event=requeued" not in out, out
        assert not (slurm.bed.root / "etcd.0").exists()
        assert run.client.get_json(run.client.key("jobs", run.job, "state"))["state"] == "FAILED"
    finally:
        run.close()


# -- slow: a host lost for good, not the first -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("slurm", [(("host1", "host2", "host3"), False)], indirect=True)
def test_power_off_of_a_host_the_job_goes_on_and_completes(slurm, dataset):
    steps = 60
    run = _start(slurm, dataset, steps, env={"MARIND_SLURM_DRAIN": "1"})
    try:
        wait_for(lambda: run.safely(lambda: run.world_size(run.job) == 6 and run.step(run.job) >= EVERY + 2),
                 900, "the run training on 3 hosts past its first checkpoint", interval=0.5, diag=run.diag)
        rank0 = _host_of_rank0(run)
        victim = rank0 if rank0 != "host1" else "host3"      # never the first: it runs the script and etcd
        frozen = slurm.bed.power_off(victim)
        assert frozen, f"nothing ran in {victim}"
        host_faults.kill_host_processes(slurm.bed.host(victim))
        lost_at = run.step(run.job)
        log.info("powered_off", victim=victim, step=lost_at, rank0=rank0)
        wait_for(lambda: run.world_size(run.job) == 4 and run.step(run.job) > lost_at, 600,
                 "the survivors training without the lost host", interval=0.5, diag=run.diag)
        wait_for(lambda: _down_or_drained(slurm, victim), 300, f"Slurm marking {victim} down", interval=1,
                 diag=run.diag)
        assert slurm.job(run.slurm_job)["JobState"] == "RUNNING", run.diag()      # --no-kill kept it
        rec = run.wait_slurm()
        assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", run.diag()
        node = slurm.node(victim)
        log.info("slurm_final", job=rec.get("JobState"), exit_code=rec.get("ExitCode"), nodes=rec.get("NodeList"),
                 victim_state=node.get("State"), victim_reason=node.get("Reason"), sinfo=slurm.node_states())
        assert _down_or_drained(slurm, victim), node
        assert "DRAIN" in node["State"] and "marind lost it" in node.get("Reason", ""), node
        assert victim not in rec.get("NodeList", ""), rec                # Slurm took it out of the job
        run.reopen_etcd()
        _check_checkpoints(run, run.url, steps)
        lost = [e for e in run.events(run.job) if e["kind"] == "node_lost"]
        assert [e["detail"]["node"] for e in lost] == [victim], run.events(run.job)
        assert lost[0]["detail"]["cause"] == "host_silent", lost
        out = run.output()
        assert f"event=node_lost node={victim}" in out and f"event=node_drained node={victim}" in out, out
        assert sorted(run.losses(run.job)) == list(range(1, steps + 1))
    finally:
        run.close()


def _host_of_rank0(run: SlurmRun) -> str:
    recs = run.client.get_prefix_json(run.client.key("jobs", run.job, "nodes") + "/")
    for key, rec in recs.items():
        if any(isinstance(w, dict) and w.get("rank") == 0 for w in rec.get("workers") or []):
            return key.rsplit("/", 1)[-1]
    raise AssertionError(f"no node holds rank 0: {recs}")


def _down_or_drained(slurm: SlurmBed, name: str) -> bool:
    try:
        state = slurm.node(name).get("State", "")
    except (subprocess.SubprocessError, RuntimeError):
        return False
    return "DOWN" in state or "DRAIN" in state




# -- requeue: a job that cannot run for a reason outside the program -------------------------------------

@pytest.mark.slow            # Slurm starts a requeued job again only minutes later (its begin time)
@pytest.mark.parametrize("slurm", [(("host1", "host2"), True)], indirect=True)
def test_etcd_unreachable_requeues_once_then_fails(slurm):
    """The site's etcd does not answer: the script exits 3 and asks Slurm to requeue the job; the second
    try (``SLURM_RESTART_COUNT=1``, at ``MARIND_SLURM_MAX_REQUEUES=1``) gives up: FAILED, exit code 3."""
    from marind.core.netutil import free_port
    spec = slurm.bed.root / "never.toml"
    spec.write_text('[job]\nname = "never"\nnproc_per_node = 1\ncommand = ["true"]\n')
    dead = f"http://{slurm.bed.plan.server_addrs['control']}:{free_port(slurm.bed.plan.server_addrs['control'])}"
    run = SlurmRun(slurm, spec, "", env={"MARIND_ETCD": dead, "MARIND_SLURM_ETCD_WAIT": "3",
                                         "MARIND_SLURM_MAX_REQUEUES": "1"})
    try:
        rec = run.wait_slurm(timeout=600)
        assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "3:0", run.diag()
        assert rec.get("Restarts") == "1", rec
        out = run.output()
        assert out.count("event=requeued restarts=0") == 1 and "event=requeue_skipped restarts=1" in out, out
    finally:
        run.close()
