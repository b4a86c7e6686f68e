import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Spawned ranks inherit sys.path: the spawn helper and the torchrun script's checks import from here.
for path in (
    HERE,
    os.path.join(HERE, "special_distributed"),
    os.path.join(HERE, "utils"),
    os.path.dirname(HERE),
):
    if path not in sys.path:
        sys.path.insert(0, path)
