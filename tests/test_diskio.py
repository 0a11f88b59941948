"""Checkpoint files written past the page cache: the same bytes as the libraries' own writers, hashed right."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import save_file

from finetune.checkpoint import diskio
from finetune.checkpoint.diskio import HashedFile, write_safetensors


def _tensors():
    torch.manual_seed(0)
    return {"b.weight": torch.randn(33, 17), "a.bias": torch.randn(5).bfloat16(), "step": torch.tensor(3),
            "empty": torch.zeros(0, 4), "half": torch.randn(9, 3).half(), "t": torch.randn(6, 4).t()}


@pytest.fixture(params=["direct", "buffered"])
def folder(request, tmp_path, monkeypatch):
    """A folder written with O_DIRECT, and one as where the platform has none (the buffered path)."""
    if request.param == "buffered":
        monkeypatch.delattr(os, "O_DIRECT")
    return tmp_path


def test_safetensors_streamed_equal_the_librarys_file_byte_for_byte(folder, monkeypatch):
    monkeypatch.setattr(diskio, "CHUNK", 2 * diskio.BLOCK)  # many chunks, a padded tail
    tensors = _tensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "library.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "library-meta.safetensors", metadata={"format": "pt"})
    with HashedFile(folder / "ours-meta.safetensors") as out:
        write_safetensors(tensors, out, metadata={"format": "pt"})  # as merged models are written
    assert (folder / "ours-meta.safetensors").read_bytes() == (folder / "library-meta.safetensors").read_bytes()
    with HashedFile(folder / "ours.safetensors") as out:
        write_safetensors(tensors, out)
    data = (folder / "ours.safetensors").read_bytes()
    assert data == (folder / "library.safetensors").read_bytes()
    assert out.size == len(data) and out.sha256 == hashlib.sha256(data).hexdigest()
    assert out.direct == hasattr(os, "O_DIRECT")


def test_torch_save_through_the_writer_loads_back_equal(folder, monkeypatch):
    monkeypatch.setattr(diskio, "CHUNK", 3 * diskio.BLOCK)
    state = {"state": {0: {"exp_avg": torch.randn(1000, 7)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    with HashedFile(folder / "optimizer.pt") as out:
        torch.save(state, out)
    data = (folder / "optimizer.pt").read_bytes()
    assert len(data) % diskio.BLOCK and out.size == len(data)  # the padding of the last block was cut
    assert out.sha256 == hashlib.sha256(data).hexdigest()
    back = torch.load(folder / "optimizer.pt", weights_only=True)
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"]) and back["param_groups"] == state["param_groups"]


def test_a_dtype_safetensors_cannot_hold_is_named(tmp_path):
    with HashedFile(tmp_path / "x.safetensors") as out, pytest.raises(ValueError, match="bad: safetensors cannot hold"):
        write_safetensors({"bad": torch.zeros(2, dtype=torch.complex128)}, out)
