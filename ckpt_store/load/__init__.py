"""Internal to ``ckpt_store``: reading a committed step into any layout, and checking one.

Modules:

* ``load_newest``: loading the newest committed step that loads clean, on every rank alike (docs/design.md §4).
* ``loader``: the read side: manifest, load into this rank's layout, verify.
* ``verify``: ``verify``: re-read every object of a committed step and check its size and checksums.
"""
