"""fsdp2_ext.verl with the real VERL (CPU, Gloo): VERL's own functions, called as its FSDP2
engine calls them, give exact shards, kept ties and restored buffers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch
import torch.distributed as dist

from fsdp2_ext.testing.spawn import run_distributed

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None:
    pytest.skip("verl (and ray, which it imports) are not installed", allow_module_level=True)

from fsdp2_ext.testing.tiny_models import build_qwen2  # noqa: E402
from tests.special_distributed import test_fsdp2_full_state_load as checks  # noqa: E402

pytestmark = pytest.mark.distributed


def _verl():
    import verl.utils.fsdp_utils as fsdp_utils
    import verl.utils.tensordict_utils as tensordict_utils
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl

    import fsdp2_ext.verl as shim

    return shim, fsdp_utils, tensordict_utils, transformer_impl


def test_install_is_idempotent_and_rebinds_by_name_imports():
    shim, fsdp_utils, tensordict_utils, transformer_impl = _verl()
    assert shim.install() == shim.install()
    for name in ("apply_fsdp2", "fsdp2_load_full_state_dict"):
        assert getattr(transformer_impl, name) is getattr(fsdp_utils, name)  # by-name import too
        assert getattr(fsdp_utils, name).__module__ == "fsdp2_ext.verl.engine"
    assert tensordict_utils.maybe_fix_3d_position_ids.__module__ == "fsdp2_ext.verl.positions"
    assert all(v.__module__.startswith("verl.") for v in shim.ORIGINALS.values())


# Each order in a fresh interpreter: VERL's modules, the shim, and VERL's own external_lib hook.
_ORDERS = {
    "shim_first": "import fsdp2_ext.verl; import verl.workers.engine_workers",
    "shim_after_workers": "import verl.workers.engine_workers; import fsdp2_ext.verl",
    "engine_package_first": (
        "import verl.workers.engine; import fsdp2_ext.verl; import verl.workers.engine_workers"
    ),
    "external_lib_after_workers": (
        "import verl.workers.engine_workers, verl.workers.engine_workers_tinker\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "import_external_libs('fsdp2_ext.verl')"
    ),
    "verl_use_external_modules": "import verl.workers.engine_workers",
}
_LIST_HOLDERS = """
import sys
for name in ("verl.workers.engine_workers_tinker", "verl.trainer.ppo.ray_trainer",
             "verl.workers.engine.fsdp.fsdp_turbo_impl"):
    try:
        __import__(name)
    except ImportError:
        pass
import fsdp2_ext.verl as shim
from fsdp2_ext.common.patching import holders_of
left = [f"{m}.{a}" for m, a, _ in holders_of(shim.ORIGINALS.values())]
ours = {id(p.replacement) for p in shim.PATCHES}
sites = ["verl.workers.engine_workers.maybe_fix_3d_position_ids",
         "verl.workers.engine.base.maybe_fix_3d_position_ids",
         "verl.workers.engine_workers_tinker.maybe_fix_3d_position_ids",
         "verl.workers.engine.fsdp.transformer_impl.apply_fsdp2",
         "verl.workers.engine.fsdp.transformer_impl.fsdp2_load_full_state_dict",
         "verl.trainer.ppo.ray_trainer.left_right_2_no_padding"]
unpatched = [s for s in sites if id(getattr(sys.modules[s.rsplit(".", 1)[0]], s.rsplit(".", 1)[1])) not in ours]
print("LEFT", left, "UNPATCHED", unpatched)
assert not left and not unpatched
"""


@pytest.fixture(scope="module")
def import_orders(tmp_path_factory):
    """Every order's fresh interpreter, started together (each is one process importing VERL,
    ~12 s of one core: side by side they use both); order -> (process, its output file)."""
    directory = tmp_path_factory.mktemp("import_orders")
    started = {}
    for order, code in _ORDERS.items():
        env = dict(os.environ)
        if order == "verl_use_external_modules":
            env["VERL_USE_EXTERNAL_MODULES"] = "fsdp2_ext.verl"
        output = directory / f"{order}.log"
        with output.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-c", code + "\n" + _LIST_HOLDERS], env=env, stdout=out,
                stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        started[order] = (process, output)
    yield started
    for process, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_every_call_site_resolves_to_the_replacement_in_any_import_order(order, import_orders):
    process, output = import_orders[order]
    try:
        returncode = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    text = output.read_text()
    assert returncode == 0, text[-6000:]
    assert "LEFT [] UNPATCHED []" in text


_ATOMIC = """
import sys
import verl.utils.fsdp_utils as fsdp_utils
sys.modules["verl.workers.utils.padding"] = None  # its import fails
try:
    import fsdp2_ext.verl
except ImportError as error:
    assert "left unpatched" in str(error), error
else:
    raise AssertionError("install should have failed")
assert fsdp_utils.apply_fsdp2.__module__ == "verl.utils.fsdp_utils"  # nothing was written
del sys.modules["verl.workers.utils.padding"]
import fsdp2_ext.verl as shim  # a retry records VERL's own functions as the originals
assert all(v.__module__.startswith("verl.") for v in shim.ORIGINALS.values())
assert fsdp_utils.apply_fsdp2.__module__ == "fsdp2_ext.verl.engine"
print("ATOMIC OK")
"""


def test_install_is_atomic_and_a_retry_sees_the_originals():
    result = subprocess.run(
        [sys.executable, "-c", _ATOMIC], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "ATOMIC OK" in result.stdout


def test_models_without_no_placement_params_move_exactly_as_under_verl(monkeypatch):
    """VERL's own contract (its tests/utils/test_fsdp2_model_transfer_on_cpu.py): the FSDP2
    transfer helpers call ``model.to`` once, non-blocking, to VERL's device id."""
    _, fsdp_utils, _, _ = _verl()
    model = Mock()
    fsdp_utils.offload_fsdp2_model_to_cpu(model, empty_cache=False)
    model.to.assert_called_once_with("cpu", non_blocking=True)
    model, device = Mock(), object()
    monkeypatch.setattr(fsdp_utils, "get_device_id", lambda: device)
    fsdp_utils.load_fsdp2_model_to_gpu(model)
    model.to.assert_called_once_with(device, non_blocking=True)
    plain = torch.nn.Linear(2, 2)
    calls = []
    monkeypatch.setattr(plain, "to", lambda *a, **k: calls.append((a, k)) or plain)
    fsdp_utils.offload_fsdp2_model_to_cpu(plain, empty_cache=False)
    assert calls == [(("cpu",), {"non_blocking": True})]


def test_verl_wrap_selection_is_non_overlapping_after_install():
    from tests.utils.test_fsdp2_peft_wrapping import NestedModel, paths

    shim, fsdp_utils, _, _ = _verl()
    model = NestedModel()
    model.config = SimpleNamespace(tie_word_embeddings=False)  # VERL reads the tie from the config
    ours = paths(model, fsdp_utils._select_fsdp2_wrap_targets(model, ["BlockWithEmbedding"]))
    theirs = paths(
        model,
        shim.ORIGINALS["verl.utils.fsdp_utils._select_fsdp2_wrap_targets"](
            model, ["BlockWithEmbedding"]
        ),
    )
    assert ours == ["embed", "blocks.0", "blocks.1"]
    assert "blocks.0.table" in theirs  # VERL's own selection nests (the negative control)


class _ExposingWrapper(torch.nn.Module):
    """Shaped like PEFT's ``ModulesToSaveWrapper`` in VERL's own wrap test: the inner embedding's
    ``weight`` registered on the wrapper too (one Parameter, two names, one branch)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.original_module = inner
        self.weight = inner.weight


def _wrap_cases():
    """(name, model): models whose selection VERL decides from the config alone."""
    from peft import LoraConfig, get_peft_model

    from tests.utils.test_fsdp2_peft_wrapping import tiny_qwen2

    exposing = tiny_qwen2(tied=False)
    exposing.model.embed_tokens = _ExposingWrapper(exposing.model.embed_tokens)
    exposing_tied = tiny_qwen2(tied=True)
    exposing_tied.model.embed_tokens = _ExposingWrapper(exposing_tied.model.embed_tokens)
    exposing_tied.lm_head.weight = exposing_tied.model.embed_tokens.weight
    modules_to_save = get_peft_model(
        tiny_qwen2(tied=False),
        LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    )
    untied_by_checkpoint = tiny_qwen2(tied=True)  # a tied config, a head the checkpoint unties
    untied_by_checkpoint.lm_head.weight = torch.nn.Parameter(
        untied_by_checkpoint.lm_head.weight * 2
    )
    untied_by_checkpoint.all_tied_weights_keys.clear()  # as tie_weights leaves it (its pop)
    return {
        "untied": tiny_qwen2(tied=False),
        "tied": tiny_qwen2(tied=True),
        "exposing_wrapper_untied": exposing,
        "exposing_wrapper_tied": exposing_tied,
        "peft_modules_to_save": modules_to_save,
        "tied_config_untied_parameters": untied_by_checkpoint,
    }


@pytest.mark.parametrize("case", sorted(_wrap_cases()))
def test_wrap_selection_decides_ties_as_verl_does(case):
    """The shim's selection is VERL's own, less what VERL nests inside another target (outermost
    wins): a wrapper that exposes its inner weight again is no tie (VERL's
    test_peft_wrapped_model_wraps_embed_tokens_by_name), the config decides as VERL reads it."""
    from tests.utils.test_fsdp2_peft_wrapping import paths

    shim, fsdp_utils, _, _ = _verl()
    model = _wrap_cases()[case]
    layers = ["Qwen2DecoderLayer"]
    ours = paths(model, fsdp_utils._select_fsdp2_wrap_targets(model, layers))
    verl_own = shim.ORIGINALS["verl.utils.fsdp_utils._select_fsdp2_wrap_targets"]
    theirs = paths(model, verl_own(model, layers))
    outermost = [p for p in theirs if not any(p.startswith(q + ".") for q in theirs if q != p)]
    assert ours == outermost, (ours, theirs)
    embed = next(p for p in theirs + ["-"] if p.endswith("embed_tokens") or p == "-")
    assert (embed != "-") == (case in {"untied", "exposing_wrapper_untied", "peft_modules_to_save"})


def _engine_build(rank, world_size):
    """The FSDP2 branch of VERL's FSDPEngine._build_fsdp_module, with VERL's own functions."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, fsdp_utils, _, transformer_impl = _verl()
    reference, module = build_qwen2(rank, tied=True)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        ),
        "offload_policy": None,
        "reshard_after_forward": True,
    }
    full_state = module.state_dict()  # real on rank 0, meta elsewhere: exactly what VERL passes
    with checks.module_to_forbidden():
        transformer_impl.apply_fsdp2(module, fsdp_kwargs, {"wrap_policy": {}})
        transformer_impl.fsdp2_load_full_state_dict(module, full_state, mesh, None)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    for name, param in module.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), atol=0, rtol=0, msg=name
        )
    assert torch.equal(module.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    checks.adamw_step(module)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    fsdp_utils.offload_fsdp2_model_to_cpu(
        module
    )  # no tables: VERL's own helpers ([Note: do no harm])
    fsdp_utils.load_fsdp2_model_to_gpu(module)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    dist.barrier()


def test_verl_engine_flow_gives_exact_shards_ties_and_buffers():
    from fsdp2_ext.testing.verl_engine import (
        ENGINE_ENV,  # VERL on its CPU platform, as in a CPU run
    )

    run_distributed(2, _engine_build, timeout_s=240, env=ENGINE_ENV)


# (C rows, sample lengths): equal lengths, B = 1, b*C == L, L == C, unequal lengths.
_POSITION_CASES = {
    "equal_c4": (4, [6, 6, 6]),
    "equal_c3": (3, [5, 5]),
    "one_sample": (4, [9]),
    "b_times_c_is_l_c3": (3, [6, 6]),
    "b_times_c_is_l_c4": (4, [8, 8]),
    "four_samples_length_2c": (3, [6, 6, 6, 6]),
    "l_equals_c_one": (4, [4]),
    "l_equals_c_many": (3, [3, 3]),
    "unequal": (4, [3, 7, 5]),
}


def _batch_with_witness(rows, lengths):
    from tensordict import TensorDict

    from fsdp2_ext import positions

    samples = [torch.arange(rows * n).view(rows, n) + 1000 * b for b, n in enumerate(lengths)]
    input_ids = torch.nested.nested_tensor_from_jagged(
        torch.arange(sum(lengths)), offsets=torch.tensor([0, *torch.tensor(lengths).cumsum(0)])
    )
    batch = TensorDict(
        {"position_ids": positions.nested_from_list(samples), "input_ids": input_ids},
        batch_size=[len(lengths)],
    )
    return batch, samples


def _assert_samples(ids, samples):
    from fsdp2_ext import positions

    assert ids._ragged_idx == 2 and ids.values().shape == (
        samples[0].shape[0],
        sum(s.shape[1] for s in samples),
    )
    for got, expected in zip(positions.unbind(ids), samples):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", sorted(_POSITION_CASES))
def test_position_ids_survive_verl_serialize_dispatch_and_repair(case):
    from verl.protocol import serialize_tensordict
    from verl.utils import tensordict_utils as tu

    shim, _, tensordict_utils, _ = _verl()
    rows, lengths = _POSITION_CASES[case]
    batch, samples = _batch_with_witness(rows, lengths)
    wire = serialize_tensordict(batch)

    ours = shim.positions.deserialize_tensordict(wire)  # explicit layout on the way in
    _assert_samples(ours["position_ids"], samples)

    # A process without the shim deserialised it: as_nested_tensor's reading, then VERL's hook.
    theirs = shim.ORIGINALS["verl.protocol.deserialize_tensordict"](wire)
    tensordict_utils.maybe_fix_3d_position_ids(theirs)
    _assert_samples(theirs["position_ids"], samples)

    # VERL's dispatch: chunk per rank and index_select (the shuffling dataloader) keep the layout.
    chunks = tu.chunk_tensordict(ours, 2 if len(lengths) % 2 == 0 else 1)
    start = 0
    for part in chunks:
        count = part.batch_size[0]
        tensordict_utils.maybe_fix_3d_position_ids(part)
        _assert_samples(part["position_ids"], samples[start : start + count])
        start += count
    order = list(reversed(range(len(lengths))))
    picked = tu.index_select_tensor_dict(ours, torch.tensor(order))
    _assert_samples(picked["position_ids"], [samples[i] for i in order])


def test_left_right_2_no_padding_nests_four_row_ids_explicitly():
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    from fsdp2_ext import positions

    _verl()
    mask = torch.ones(2, 6, dtype=torch.long)
    ids = torch.arange(2 * 4 * 6).view(2, 4, 6)
    batch = TensorDict(
        {"input_ids": torch.zeros(2, 6, dtype=torch.long), "attention_mask": mask,
         "response_mask": torch.ones(2, 3, dtype=torch.long), "position_ids": ids},
        batch_size=[2],
    )  # fmt: skip
    nested = left_right_2_no_padding(batch)["position_ids"]
    assert nested._ragged_idx == 2 and nested.values().shape == (4, 12)
    for got, expected in zip(positions.unbind(nested), ids):
        assert torch.equal(got, expected)


def test_negative_control_verl_relabel_breaks_equal_length_ids():
    from verl.protocol import serialize_tensordict

    shim, _, _, _ = _verl()
    batch, _ = _batch_with_witness(4, [6, 6, 6])
    theirs = shim.ORIGINALS["verl.protocol.deserialize_tensordict"](serialize_tensordict(batch))
    shim.ORIGINALS["verl.utils.tensordict_utils.maybe_fix_3d_position_ids"](theirs)
    with pytest.raises(RuntimeError, match="split_with_sizes|Expected cond to be True"):
        theirs["position_ids"].unbind()  # VERL's blind _ragged_idx = 2 on the packed reading
