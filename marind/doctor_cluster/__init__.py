"""`marind doctor --cluster`: one short all-reduce across every registered host, through the agents.

* ``keys``: the request and the run's etcd keys (docs/design.md §2), and the request record;
* ``verdict``: the pure decisions (which hosts form the group given who reaches whom, the
  report's rows and verdict, bus bandwidth);
* ``probe``: the short-lived process an agent starts for a request (``python -m
  marind.doctor_cluster.probe``): TCP reachability, then the all-reduce;
* the CLI's side (write the request, wait for the results, clean up) is ``marind.commands.cluster_check``.

Nothing here imports torch at module level except ``probe``'s collective part.
"""
