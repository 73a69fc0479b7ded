"""The per-node daemon behind `marind agent` (DESIGN §1, §2).

Modules, one concept each: ``config`` (agent settings and the etcd
endpoint lookup), ``jobstate`` (the job state enum and the one transition
function), ``hang`` (pure stall detection), ``progress`` (workers'
progress records), ``events`` (the bounded event ring), ``registry``
(node registration under a lease), ``supervisor`` (one torchrun per
job), ``daemon`` (the main loop).
"""
