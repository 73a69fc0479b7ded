"""The control-plane client: what the CLI and the agent both need of etcd (docs/design.md §2, §5).

The agent (``marind.agent``) builds on this package; the CLI (``marind.commands``), the test bed
(``marind.testing``) and the chaos scripts use it and never import the daemon's code
(``tools/import_graph.py --check`` enforces it, so ``marind status`` loads no agent module).

* ``config``: ``marind.toml`` (read by the agent and the CLI alike), the agent's settings, the
  state dirs, and the one etcd endpoint lookup with the client settings;
* ``jobs_client``: ``JobsClient`` and ``connect``, the library behind ``marind submit / status /
  events / cancel / logs / nodes / rm``;
* ``job_records``: a job's keys, read and written the one way; ``lifecycle``: the job states and
  the one transition function; ``events``: the bounded event ring;
* ``failure_causes``: why a rank failed, in words a user acts on (pure: kinds, lines, fixes);
* ``change_watch``: when to read the jobs again (a change, or a slow resync);
* ``nodes``: the registered nodes; ``ft_status``: a torchft job's keys and its status;
* ``goodput_ledger``: where a job's wall time went (a pure fold over its events and rank 0's
  records); ``job_series``: its bounded curves; ``job_history``: both as readers see them;
* ``auth_roles``: the etcd roles (viewer, submitter, agent) and the owner prefix of job ids;
  ``job_signing``: signed job specs (canonical form, Ed25519 sign and verify, key files);
* ``local_etcd``: a single-member etcd server as a child process (the agent's ``--embedded``
  mode, the demo, the tests and the benches).
"""
