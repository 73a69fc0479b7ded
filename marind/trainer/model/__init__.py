"""The trainer's model: what the parameters are and what the forward pass computes.

Nothing here knows how it is parallelised: expert parallelism hands the experts a dispatcher
(``moe.ExpertDispatcher``) and the pipeline installs an aux-loss hook (``moe.AuxHook``).

* ``gpt``: a decoder-only transformer small enough to read top to bottom;
* ``moe``: mixture of experts: a top-k router in float32 and stacked SwiGLU experts;
* ``moe_spec``: the mixture-of-experts part of the spec (presets, the checks of ``[model]``);
* ``meta_init``: initial weights that do not depend on the layout (one generator per parameter).
"""
