"""Hugging Face interop: the trainer's checkpoints out to ``transformers``, and weights in.

* ``mapping``: the GPT as ``LlamaForCausalLM`` (config, parameter names, rotary layout);
  ``mixtral``: the MoE GPT as ``MixtralForCausalLM``;
* ``export``: a committed checkpoint as a Hugging Face directory (``marind ckpt export --format hf``);
* ``init_from``: ``[model] init_from``: start from a Hugging Face Llama directory.
"""
