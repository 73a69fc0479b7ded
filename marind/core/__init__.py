"""The bottom layer of marind: errors, logging, the etcd client (with ``etcd_auth``, its auth
admin calls for `marind auth setup`), the job spec and the names of the worker environment.
Nothing here imports anything else of marind."""
