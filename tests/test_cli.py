"""`fsdp2-ext` command line (fsdp2_ext.cli)."""

from __future__ import annotations

import json

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
