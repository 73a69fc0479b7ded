"""Internal to ``ckpt_store``: the bytes at rest, and the math that maps a state dict onto them.

Pure functions and small readers: nothing here starts a thread or runs a collective.

Modules:

* ``layout``: Layout math: which global box each rank holds, the chunk grid, who writes which chunk.
* ``manifest``: A step's ``manifest.json``: the commit record, read and checked in one place.
* ``plan``: from a nested state dict to a save/load plan: array names, layouts, owned chunks, snapshots.
* ``retention``: Retention and garbage collection decisions (pure).
* ``steps``: Step directories under a store root: names, listing, committed steps, retention applied.
* ``zarr_bf16``: Teach zarr-python 3.1 the Zarr v3 data type ``"bfloat16"`` (tensorstore reads it natively).
* ``zarr_format``: Zarr v3 on-disk format, written by hand: array/group metadata, chunk keys, chunk codecs.
"""
