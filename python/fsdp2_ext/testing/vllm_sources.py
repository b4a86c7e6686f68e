"""vLLM releases' sources, as their sdists on PyPI have them: fetched once, checked against their
published SHA-256, unpacked (the ``vllm/`` Python tree only) into a cache, for
``fsdp2_ext.vllm.vllm_contract.check``.

    FSDP2_EXT_CACHE=~/.cache/fsdp2_ext   # where (default); vllm-sdists/ and vllm-src/<version>/

The URLs and digests are PyPI's (``https://pypi.org/simple/vllm/``, 2026-12-07); a download that
does not match its digest is refused and removed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request

__all__ = ["SDISTS", "cache_directory", "release_source"]

_FILES = "https://files.pythonhosted.org/packages"
SDISTS = {  # version -> (url, sha256)
    "0.32.0": (
        f"{_FILES}/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz",
        "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    ),
    "0.33.0": (
        f"{_FILES}/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
    "0.34.0": (
        f"{_FILES}/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    ),
}


def cache_directory() -> str:
    return os.environ.get("FSDP2_EXT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fsdp2_ext"
    )


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sdist(version: str, cache: str) -> str:
    url, sha256 = SDISTS[version]
    path = os.path.join(cache, "vllm-sdists", os.path.basename(url))
    if os.path.isfile(path) and _sha256(path) == sha256:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=120) as response:
            shutil.copyfileobj(response, out, 1 << 20)
        got = _sha256(partial)
        if got != sha256:
            raise RuntimeError(f"{url}: SHA-256 {got}, PyPI publishes {sha256}: refused")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def release_source(version: str, cache: str | None = None) -> str:
    """The directory holding release ``version``'s ``vllm/`` package source (its ``.py`` files)."""
    if version not in SDISTS:
        raise KeyError(f"vLLM {version}: no sdist known here (known: {', '.join(SDISTS)})")
    cache = cache or cache_directory()
    root = os.path.join(cache, "vllm-src", version)
    done = os.path.join(root, ".unpacked")
    if os.path.isfile(done):
        return root
    sdist = _sdist(version, cache)
    prefix = f"vllm-{version}/vllm/"
    os.makedirs(os.path.dirname(root), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(root))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [
                m for m in tar.getmembers()
                if m.isfile() and m.name.startswith(prefix) and m.name.endswith(".py")
            ]  # fmt: skip
            for member in members:
                member.name = member.name[len(f"vllm-{version}/") :]
            tar.extractall(staging, members=members, filter="data")
        open(os.path.join(staging, ".unpacked"), "w").close()
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
