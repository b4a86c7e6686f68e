"""The safetensors reader enforces the format's rules: a bad file is a ValueError naming the file
and the tensor or field, never a view past the mapping, a silent guess or a blocked open()."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state


def write_raw(path, header: dict | bytes, data: bytes = b"", *, pad_to: int = 8) -> str:
    """A file with this header (a dict is dumped as JSON, bytes are written as they are)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def entry(dtype: str, shape, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_a_well_formed_file_maps_exactly(tmp_path):
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.tensor([1, 2], dtype=torch.int16)}
    save_file(tensors, tmp_path / "ok.safetensors", metadata={"format": "pt"})
    state = map_safetensors_state([tmp_path / "ok.safetensors"])
    assert all(torch.equal(state[k], v) for k, v in tensors.items())


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        # Sizes that overflow 64-bit arithmetic (UBSan: signed overflow, then a view past the file).
        ({"t": entry("F64", [2**61], 0, 0)}, b"", "overflows 64-bit byte counts"),
        ({"t": {"dtype": "U8", "shape": [2**62], "data_offsets": [2**62, -(2**63)]}}, b"", "non-negative"),
        ({"t": entry("U8", [2**62, 4], 0, 0)}, b"", "overflows"),
        # The format's layout rules.
        ({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, bytes(6), "overlaps"),
        ({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, bytes(6), "a hole precedes it"),
        ({"a": entry("U8", [2], 0, 2)}, bytes(6), "trailing bytes"),
        ({"a": entry("U8", [4], 0, 4)}, bytes(2), "the data section holds 2"),
        ({"a": entry("U8", [4], 4, 0)}, bytes(4), "begin <= end"),
        # Types: floats are not integers, lists are not strings.
        ({"a": entry("U8", [2.5], 0, 2)}, bytes(2), "shape must be a non-negative 64-bit integer"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0.0, 2.0]}}, bytes(2), "data_offsets"),
        ({"a": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, bytes(2), "non-negative"),
        ({"a": {"dtype": 3, "shape": [2], "data_offsets": [0, 2]}}, bytes(2), "dtype must be a string"),
        ({"a": {"dtype": "U8", "shape": [2]}}, bytes(2), "needs an object with dtype, shape"),
        ({"a": entry("Q7", [2], 0, 2)}, bytes(2), "unsupported dtype 'Q7'"),
        ({"__metadata__": {"n": 3}}, b"", "__metadata__['n'] must be a string"),
        ({"__metadata__": ["x"]}, b"", "__metadata__ must be a map of strings to strings"),
        (b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
         b'"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', bytes(2), "the key 'a' twice"),
        (b'{"a": {"dtype": "U8", "dtype": "F32", "shape": [2], "data_offsets": [0, 2]}}', bytes(2),
         "the key 'dtype' twice"),
        (b"[1, 2]", b"", "not a JSON object"),
        (b'{"a": ', b"", "malformed safetensors header"),
    ],
)  # fmt: skip
def test_malformed_files_are_refused_naming_the_file(tmp_path, header, data, message):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match="bad.safetensors") as caught:
        map_safetensors_state([path])
    assert message in str(caught.value)


def test_a_header_larger_than_the_file_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ValueError, match="exceeds the file"):
        map_safetensors_state([path])


def test_a_non_utf8_key_keeps_the_message(tmp_path):
    path = write_raw(tmp_path / "latin1.safetensors", b'{"caf\xe9": {}}')
    with pytest.raises(ValueError, match="latin1.safetensors") as caught:  # not UnicodeDecodeError
        map_safetensors_state([path])
    assert "malformed safetensors header" in str(caught.value)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        map_safetensors_state([fifo])


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises((ValueError, OSError), match="dir.safetensors"):
        map_safetensors_state([tmp_path / "dir.safetensors"])


def test_a_single_path_instead_of_a_list_is_a_type_error(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "one.safetensors")
    with pytest.raises(TypeError, match="must be a list of files"):
        map_safetensors_state(str(tmp_path / "one.safetensors"))


def test_zero_size_tensors_share_an_offset(tmp_path):
    path = write_raw(
        tmp_path / "empty.safetensors",
        {"e": entry("F32", [0, 3], 0, 0), "a": entry("F32", [1], 0, 4)},
        struct.pack("<f", 1.5),
    )
    state = map_safetensors_state([path])
    assert state["e"].shape == (0, 3) and state["a"].item() == 1.5


def test_a_misaligned_tensor_loads_by_copy_with_the_reason_logged_once(tmp_path, caplog):
    """Valid by the format (it requires no alignment) and loaded by safetensors itself: read as
    a copy, since a view at an odd address is not a tensor torch may compute on."""
    from safetensors.torch import load_file

    values = struct.pack("<3f", 1.5, -2.0, 3.25)
    path = write_raw(
        tmp_path / "odd.safetensors",
        {
            "a": entry("U8", [1], 0, 1),
            "b": entry("F32", [3], 1, 13),
            "c": entry("F32", [1], 13, 17),
        },
        b"\x07" + values + struct.pack("<f", 4.0),
    )
    with caplog.at_level("INFO", logger="fsdp2_ext"):
        state = map_safetensors_state([path])
    expected = load_file(path)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert state["b"].data_ptr() % 4 == 0
    said = [r.getMessage() for r in caplog.records if "not aligned" in r.getMessage()]
    assert len(said) == 1 and "2 tensors" in said[0] and "'b' starts at file offset" in said[0]


def test_a_header_nested_a_million_deep_is_refused_not_a_crash(tmp_path):
    """nlohmann's parser recurses per level: without the depth limit this is a SIGSEGV."""
    nested = b'{"__metadata__": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}"
    path = write_raw(tmp_path / "deep.safetensors", nested)
    with pytest.raises(ValueError, match="deep.safetensors") as caught:
        map_safetensors_state([path])
    assert "deeper than 128 levels" in str(caught.value)


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    path = write_raw(
        tmp_path / "strings.safetensors",
        {"__metadata__": {"note": "[" * 500 + '\\"{'}, "t[0]": entry("U8", [2], 0, 2)},
        bytes(2),
    )
    assert map_safetensors_state([path])["t[0]"].shape == (2,)
