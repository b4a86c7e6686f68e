"""`fsdp2-ext` command line (fsdp2_ext.cli)."""

from __future__ import annotations

import json

import pytest

from fsdp2_ext.cli import main


def test_cli_json_from_a_local_config(tmp_path, capsys):
    from fsdp2_ext.testing.tiny_models import tiny_qwen2_config

    tiny_qwen2_config(tied=False).save_pretrained(tmp_path)
    assert (
        main(
            [
                "plan",
                str(tmp_path),
                "--world-size",
                "2",
                "--lora-rank",
                "4",
                "--target-modules",
                "q_proj",
                "v_proj",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["model_class"] == "Qwen2ForCausalLM"
    # q_proj 8 -> 8 and v_proj 8 -> 4 per layer, 2 layers, r = 4: 4 * (16 + 12) * 2
    assert plan["lora_parameters"] == 4 * (16 + 12) * 2
    assert plan["no_placement"] == {}


def test_a_path_without_a_config_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing"), "--world-size", "2"]) == 2
    assert "neither a model directory with a config.json" in capsys.readouterr().err


def _results(path, methods: dict[str, float]) -> str:
    """A bench_cold_start.py result with the given marginal s/GiB per method (fixed 1.5 s)."""
    entry = {m: {"marginal_s_per_gib": v, "fixed_s": 1.5} for m, v in methods.items()}
    path.write_text(json.dumps({"world_size": 2, "models": {"qwen4_exp": entry}}))
    return str(path)


def test_the_cold_start_estimate_by_hand(tmp_path):
    """[Note: cold-start projection]: S = 1 GiB per rank, 16 ranks on 2 hosts, disk 6, copy 10,
    link 40 GiB/s; measured: checkpoint 2x memcpy's marginal, rank 0 3x the transport's."""
    from fsdp2_ext.plan.cold_start import GIB, estimate_cold_start

    results = _results(
        tmp_path / "cold_start.json",
        {"fsdp2_ext_checkpoint": 2.0, "memcpy_bound": 1.0, "fsdp2_ext_rank0": 3.0,
         "transport_bound": 1.0},
    )  # fmt: skip
    estimate = estimate_cold_start(GIB, 16, 2, results_path=results)
    by_method = {m.method: m for m in estimate.methods}
    assert set(by_method) == {"fsdp2_ext_checkpoint", "fsdp2_ext_rank0"}  # no VERL figure given
    checkpoint, rank0 = by_method["fsdp2_ext_checkpoint"], by_method["fsdp2_ext_rank0"]
    assert checkpoint.warm_s == pytest.approx(2 * 1 / 10)  # its 1 GiB at 10 GiB/s, 2x slower
    assert checkpoint.cold_s == pytest.approx(8 * 1 / 6)  # the host reads 8 ranks' rows
    assert rank0.warm_s == pytest.approx(3 * 15 / 40)  # 15/16 of 16 GiB over rank 0's link
    assert rank0.cold_s == pytest.approx(3 * 15 / 40 + 16 / 6)  # after reading all 16 GiB
    assert checkpoint.fixed_s_measured == 1.5
    # HSDP, 32 ranks on 4 hosts in replicas of fsdp_size 8 (S = 1 GiB per rank at 8): one
    # replica is 8 GiB; rank 0 reads it, sends 7/8 of it, then broadcasts its own 1 GiB along
    # ddp ([Note: HSDP loads]); each host still copies its own ranks' rows.
    estimate = estimate_cold_start(GIB, 32, 4, results_path=results, fsdp_size=8)
    by_method = {m.method: m for m in estimate.methods}
    assert estimate.text_bytes == 8 * GIB
    assert by_method["fsdp2_ext_rank0"].warm_s == pytest.approx(3 * (7 + 1) / 40)
    assert by_method["fsdp2_ext_rank0"].cold_s == pytest.approx(3 * 8 / 40 + 8 / 6)
    assert by_method["fsdp2_ext_checkpoint"].cold_s == pytest.approx(8 * 1 / 6)
    # 16 ranks per host, fsdp_size 8: the host's two replicas read the same 8 ranks' rows once
    estimate = estimate_cold_start(GIB, 32, 2, results_path=results, fsdp_size=8)
    by_method = {m.method: m for m in estimate.methods}
    assert by_method["fsdp2_ext_checkpoint"].cold_s == pytest.approx(8 * 1 / 6)


def test_plan_prints_the_cold_start_estimate_or_says_why_not(tmp_path, capsys):
    from fsdp2_ext.testing.tiny_models import tiny_qwen2_config

    tiny_qwen2_config(tied=False).save_pretrained(tmp_path)
    results = _results(tmp_path / "r.json", {"fsdp2_ext_checkpoint": 2.0, "memcpy_bound": 1.0})
    assert main(["plan", str(tmp_path), "--world-size", "2", "--cold-start-results", results]) == 0
    out = capsys.readouterr().out
    assert "cold start, trainer side (estimate" in out and "fsdp2_ext_checkpoint" in out
    missing = str(tmp_path / "absent.json")
    assert main(["plan", str(tmp_path), "--world-size", "2", "--cold-start-results", missing]) == 0
    assert f"no benchmark results at {missing}" in capsys.readouterr().out


def test_the_projection_takes_every_efficiency_from_the_one_model_all_methods_ran(tmp_path):
    """The tied model grows as the recipe's does and VERL can init it: VERL's ratio and ours come
    from it, not ours from qwen4_exp and VERL's from the tied model."""
    from fsdp2_ext.plan.cold_start import GIB, estimate_cold_start

    def entry(methods):
        return {m: {"marginal_s_per_gib": v, "fixed_s": 1.0} for m, v in methods.items()}

    bounds = {"memcpy_bound": 1.0, "transport_bound": 1.0}
    results = tmp_path / "cold_start.json"
    results.write_text(json.dumps({"world_size": 2, "models": {
        "tied_qwen2": entry({"verl": 7.0, "fsdp2_ext_rank0": 2.0, "fsdp2_ext_checkpoint": 1.5,
                             **bounds}),
        "qwen4_exp": entry({"fsdp2_ext_rank0": 6.0, "fsdp2_ext_checkpoint": 1.2, **bounds}),
    }}))  # fmt: skip
    estimate = estimate_cold_start(GIB, 16, 2, results_path=str(results))
    by_method = {m.method: m.efficiency for m in estimate.methods}
    assert by_method == {"verl": 7.0, "fsdp2_ext_rank0": 2.0, "fsdp2_ext_checkpoint": 1.5}
    assert "tied_qwen2" in estimate.measured_on and "qwen4_exp" not in estimate.measured_on


def test_the_tables_path_and_its_wait_bound_follow_the_recipe_and_the_knobs(monkeypatch):
    """[Note: the tables' path at the recipe's scale]: the 95.37 GiB table on 16 ranks, 2 hosts,
    disk 6, copy 10, link 40 GiB/s; the bound honours FSDP2_EXT_WAIT_FLOOR_S and
    FSDP2_EXT_MIN_BANDWIDTH_MIB_S as the ranks do."""
    from fsdp2_ext.plan.cold_start import GIB, estimate_tables

    table = 320_001_536 * 160 * 2
    x = table / GIB

    def of(**kwargs):
        return estimate_tables(table, world_size=16, nodes=2, **kwargs)

    views = of(init_source="checkpoint", shared_directory=True, views=True)
    assert views.network_bytes == 0 and views.seconds == 0 and views.longest_wait_bound_s == 60
    own = of(init_source="checkpoint", shared_directory=True, views=False)
    assert own.network_bytes == 0 and "its own mapping" in own.path
    assert own.seconds == pytest.approx(x / 6 + x / 10)
    assert own.longest_wait_bound_s == pytest.approx(60 + x * 1024 / 64, abs=0.01)
    sent = of(init_source="rank0", shared_directory=True, views=False)
    assert sent.network_bytes == table and sent.seconds == pytest.approx(x / 10 + x / 40)
    assert sent.longest_wait_bound_s == pytest.approx(60 + 3 * x * 1024 / 64, abs=0.01)
    per_rank = of(init_source="rank0", shared_directory=False, views=False)
    assert per_rank.network_bytes == 8 * table  # the other host's 8 ranks
    monkeypatch.setenv("FSDP2_EXT_WAIT_FLOOR_S", "120")
    monkeypatch.setenv("FSDP2_EXT_MIN_BANDWIDTH_MIB_S", "128")
    own = of(init_source="checkpoint", shared_directory=True, views=False)
    assert own.wait_floor_s == 120 and own.min_bandwidth_mibps == 128
    assert own.longest_wait_bound_s == pytest.approx(120 + x * 1024 / 128, abs=0.01)
    assert estimate_tables(0, world_size=16, nodes=2, init_source="rank0",
                           shared_directory=False, views=False) is None  # fmt: skip
