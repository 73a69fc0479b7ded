"""How the trainer's model is laid over ranks: the device mesh, experts, pipeline stages.

* ``mesh``: DeviceMesh (dp_replicate, dp_shard, tp), the TP plan, FSDP2, activation
  checkpointing, compile;
* ``expert``: expert parallelism over an ``ep`` mesh dimension, tokens moved by all-to-all
  (it gives the experts their dispatcher);
* ``pipeline``: the GPT split into stages by layers, their meshes, schedule and step;
  ``pipeline_spec``: ``[parallel] pp`` and friends, checked; ``pipeline_moe``: aux losses and
  router statistics per stage; ``pipeline_ckpt``: every stage's arrays under global names;
  ``pipeline_timing``: the bubble, measured;
* ``grad_norm``: the global gradient norm, one all-reduce per mesh, and clipping by it.
"""
