"""Helpers to run marind's real servers and processes in tests and benchmarks.

Like ``numpy.testing``, this package ships with marind so that the test
suite, ``bench/`` and ``chaos/`` share one copy of it (and none of them
imports ``tests``):

* ``marind.testing.procs``: the one process-spawning helper (``spawn``,
  ``kill_group``, ``kill_all``) and ``run_torch_workers``, which runs a
  function on N gloo ranks in real processes;
* ``marind.testing.s3_server``: a real S3 server (SeaweedFS) on loopback;
* ``marind.testing.s3_faults``: an S3 that pushes back: a proxy in front of it answering 503
  SlowDown / 500, resetting or delaying requests, by rate and for a window;
* ``marind.testing.small_fs``: a filesystem that fills: a size-limited tmpfs and ballast;
* ``marind.testing.etcd_metrics``: etcd's own counters (requests, writes, WAL and client bytes,
  database size) from its ``/metrics``: what a test or a bench counts a workload by;
* ``marind.testing.etcd_cluster``: a real 3- or 5-member etcd cluster (kill, kill the leader, stop and
  start a member with its data);
* ``marind.control.local_etcd.LocalEtcd``: a real etcd server (it lives beside the
  agent, which embeds it);
* ``marind.testing.cluster``: ``marind agent``s as subprocesses, submit, a
  tiny dataset (the daemon benchmarks);
* ``marind.testing.hosts``: the multi-host bed (network namespaces with their own
  hostnames, a control and a data network; ``hosts_plan`` names it, ``hosts_net``
  makes it, ``hosts_filter`` makes its links half work: one-way drops, loss);
* ``marind.testing.slurm_bed``: a real Slurm on that bed (a slurmd per host, slurmctld and
  munged on the bridge side), for ``examples/slurm``;
* ``marind.testing.chaos``: the library behind the ``chaos/`` injectors.
"""
