"""The trainer's data: token files, the sampler, and what makes them.

* ``dataset``: token datasets (``.bin`` + ``.idx``) and the deterministic, resumable sampler;
* ``corpus``: a seeded example corpus (no downloads); ``tokenize``: tokenizers for
  ``marind data prepare`` (bytes, or a local ``tokenizer.json``).
"""
