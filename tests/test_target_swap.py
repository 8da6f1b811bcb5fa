"""The in-flight swap's folder check (serving/target_swap.py), without an engine; the swap
itself runs in tests/test_target_swap_vllm.py."""

import json

import pytest


def test_check_swap_without_an_engine(smollm2_path, tmp_path):
    from vllm_onlinespec.serving.target_swap import SwapError, check_swap

    current = json.loads(open(f"{smollm2_path}/config.json").read())
    assert check_swap(current, smollm2_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(current))
    with pytest.raises(SwapError, match="no .safetensors"):
        check_swap(current, tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    (tmp_path / "empty" / "config.json").write_text("{")
    with pytest.raises(SwapError, match="not valid JSON"):
        check_swap(current, tmp_path / "empty")
