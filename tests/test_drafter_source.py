"""Where a drafter's files are (drafter/source.py): a folder, or a hub id's local snapshot as
vLLM downloaded it (same revision, same cache dir); anything else is one line naming it."""

import json

import pytest

from vllm_onlinespec.drafter.source import DrafterNotFound, looks_like_hub_id, resolve_drafter_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo="z-lab/Qwen3-8B-DFlash-b16", revision="main"):
    """The layout huggingface_hub writes: models--owner--name/{refs/<rev>, snapshots/<commit>}."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (snap / "model.safetensors").write_bytes(b"")
    (base / "refs").mkdir()
    (base / "refs" / revision).write_text(COMMIT)
    return snap


def test_local_folder_is_itself(tmp_path):
    assert resolve_drafter_dir(tmp_path) == tmp_path


def test_hub_id_resolves_to_vllms_snapshot_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = fake_hub_cache(tmp_path)
    got = resolve_drafter_dir("z-lab/Qwen3-8B-DFlash-b16", cache_dir=str(tmp_path))
    assert got == snap and (got / "config.json").is_file()


def test_hub_id_revision_is_vllms(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub_cache(tmp_path, revision="v2")
    assert resolve_drafter_dir("z-lab/Qwen3-8B-DFlash-b16", revision="v2",
                               cache_dir=str(tmp_path)).name == COMMIT
    with pytest.raises(DrafterNotFound, match="revision main"):
        resolve_drafter_dir("z-lab/Qwen3-8B-DFlash-b16", cache_dir=str(tmp_path))


@pytest.mark.parametrize("name", ["nobody/missing-drafter", "./not/a/dir", "/no/such/folder"])
def test_unresolvable_is_one_line_naming_it(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DrafterNotFound) as e:
        resolve_drafter_dir(name, cache_dir=str(tmp_path))
    msg = str(e.value)
    assert name in msg and "\n" not in msg


def test_hub_id_shape():
    assert looks_like_hub_id("z-lab/Qwen3-8B-DFlash-b16")
    assert not looks_like_hub_id("/abs/path") and not looks_like_hub_id("a/b/c")
