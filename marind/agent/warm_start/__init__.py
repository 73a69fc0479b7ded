"""Warm starts (``[job] warm_start = true``): workers forked from a process with torch imported.

* ``zygote``: the per-job fork server beside each torchrun;
* ``zygote_stub``: what torchrun runs for each worker; it asks the zygote for a fork, or runs
  the program itself when there is none.
"""
