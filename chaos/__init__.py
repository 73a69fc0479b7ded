"""Fault injectors for marind jobs (DESIGN §6).

Each ``chaos/NAME.py`` is a script: ``python chaos/NAME.py --job JOB
[--etcd URL] [--seed N] ...``. It finds its target through etcd, acts only
on processes of this machine, prints one JSON line per action on stdout
and exits 0 when it acted, 1 when it found nothing to act on. The shared
plumbing lives in the ``chaos._*`` modules.
"""
