"""A Transformers checkpoint directory as the init reads it: where each model tensor lives, its
key conversions, fingerprints and file systems (``model_checkpoint``), and the ``*.safetensors``
files mapped read-only under the format's rules (``safetensors_source``).

May import: ``common``, ``model``.
"""
