"""The job page: served read-only by every agent on its metrics port (docs/design.md §11).

* ``data``: what the page shows, read from etcd (the cluster; one job's history);
* ``svg``: the charts, the events' timeline and the ledger's bar (pure);
* ``html``: the pages and their live part (pure);
* ``server``: the routes (``/``, ``/jobs/JOB``, ``/api/...``) and the token off loopback.
"""
