"""The bottom layer of marind: errors, logging, the etcd client, the job spec and the
names of the worker environment. Nothing here imports anything else of marind."""
