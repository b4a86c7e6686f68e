"""The frozen no-placement tables: where they live for every process (``table_placement``), one
node-local copy per host mapped by every local rank (``host_shared``, with ``table_digest`` to agree
on their bytes), and served to the processes on the host that share no group with the trainer
(``host_copy``, ``table_service``).

May import: ``common``, ``model``, ``checkpoint``.
"""
