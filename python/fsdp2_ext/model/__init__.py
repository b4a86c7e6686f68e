"""What the sharded init learns of a model before it goes to meta: tied aliases and
non-persistent buffers (``aliases``), the no-placement tables it declares (``no_placement``), and
the FSDP2 wrap targets that never nest (``wrap_targets``).

May import: ``common``.
"""
