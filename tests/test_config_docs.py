"""docs/configuration.md is generated from OnlineSpecConfig and must match it."""

from pathlib import Path

from vllm_onlinespec import config_docs
from vllm_onlinespec.config import OnlineSpecConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _keys(model, prefix=""):
    for name, info in model.model_fields.items():
        if config_docs._is_section(info.annotation):
            yield from _keys(info.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, info


def test_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == config_docs.render(), (
        f"docs/configuration.md is stale: run `{config_docs.COMMAND}`")


def test_every_key_listed_with_its_description():
    page = config_docs.render()
    keys = list(_keys(OnlineSpecConfig))
    assert len(keys) > 40
    for key, info in keys:
        assert info.description, f"{key} has no description"
        row = next((ln for ln in page.splitlines() if ln.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} missing from the page"
        assert config_docs._cell(info.description) in row
    # sections are not rows of their own; a table row never breaks on a pipe in a description
    assert "| `loss` |" not in page
    assert "KL(draft\\|\\|target)" in page


def test_check_flag(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert config_docs.main(["--out", str(out), "--check"]) == 1
    assert config_docs.COMMAND in capsys.readouterr().err
    assert config_docs.main(["--out", str(out)]) == 0
    assert config_docs.main(["--out", str(out), "--check"]) == 0
