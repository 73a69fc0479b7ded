"""Internal to ``ckpt_store``: where a store's bytes go, and how (docs/design.md §4).

One small protocol over a store root and two backends; the local disk's I/O modes are
decisions (pure functions returning their reason) beside the code that acts on them.

Modules:

* ``base``: what both storage backends share: the I/O threads, the write-rate limit, keys to paths.
* ``flush_mode``: Local disks: how a rank's part of a save is made durable, ``syncfs`` or an fsync per file.
* ``local_disk``: the local-disk storage backend (file://): O_DIRECT chunk writes, pread/preadv reads, fsyncs.
* ``object_store``: the object-store backend over fsspec (s3://, memory://, any other fsspec URL).
* ``page_cache``: How much of a file range the page cache holds, asked without reading it (Linux ``cachestat(2)``).
* ``protocol``: the storage seam of ckpt_store: one small protocol over a store root, and ``open_storage``.
* ``read_mode``: Local disks: which path a load's chunk reads take, chosen from the machine's CPUs per reader.
* ``write_mode``: Local disks: which write path a save's chunk objects take, chosen from what the disk did.
"""
