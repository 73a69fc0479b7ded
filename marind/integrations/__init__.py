"""marind under other tools' front ends.

* ``marind.integrations.torchx_scheduler``: a TorchX scheduler named ``marind``
  (``torchx run -s marind dist.ddp -j 2x2 --script train.py``), registered through TorchX's
  ``torchx.schedulers`` entry point; ``torchx_spec`` turns an ``AppDef`` into a marind run spec.

These modules talk to the cluster through ``marind.control`` only, as the CLI does: never the
daemon's code (``tools/import_graph.py --check``). TorchX itself is an optional extra
(``pip install 'marind[torchx]'``), imported only by the modules that need it.
"""
