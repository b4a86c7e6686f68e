"""What every part uses, and nothing of fsdp2_ext above it: the logger shared with the C++ core
(``log``), the bounded agreement between ranks (``distributed``: ``host_id``, ``bounded_wait``,
``gather_objects``), replacing functions everywhere they are reachable (``patching``), the versions
fsdp2_ext supports (``verl_version``, ``transformers_version``), the FSDP2 internals it relies on
(``fsdp2_internals``), and small tools (``stopwatch``, ``collector``, ``procfs``, ``run_report``).

May import: the compiled core (``fsdp2_ext._fsdp2_ext``) and nothing else of fsdp2_ext
([Note: the packages' floors] in ``fsdp2_ext/__init__.py``).
"""
