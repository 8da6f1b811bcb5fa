"""The Intel OpenMP preload decision (serving/openmp.py): off unless asked for, x86 only,
idempotent, never a duplicate or a second runtime, off when the library is missing, one log
line either way."""

import logging
import os

import pytest

from vllm_onlinespec.serving import openmp

LIB = "/venv/lib/libiomp5.so"


def test_preloads_on_x86_when_the_library_is_there():
    d = openmp.decide("", x86=True, libiomp=LIB, opt_in=True)
    assert d.on and d.ld_preload == LIB and "on" in d.line()
    d = openmp.decide("/x/libtcmalloc.so", x86=True, libiomp=LIB, opt_in=True)
    assert d.on and d.ld_preload == f"/x/libtcmalloc.so:{LIB}"


def test_idempotent_and_never_duplicated():
    once = openmp.decide("/x/libtcmalloc.so", x86=True, libiomp=LIB, opt_in=True)
    twice = openmp.decide(once.ld_preload, x86=True, libiomp=LIB, opt_in=True)
    assert twice.ld_preload == once.ld_preload and twice.ld_preload.count("libiomp5") == 1
    assert twice.on and "already" in twice.reason


@pytest.mark.parametrize("kw,why", [
    (dict(x86=False, libiomp=LIB, opt_in=True), "not an x86"),
    (dict(x86=True, libiomp=None, opt_in=True), "not found"),
    (dict(x86=True, libiomp=LIB), "VLLM_ONLINESPEC_IOMP=1 preloads"),
])
def test_off_says_why(kw, why):
    d = openmp.decide("/x/libtcmalloc.so", **kw)
    assert not d.on and d.ld_preload == "/x/libtcmalloc.so" and why in d.line()


def test_never_next_to_another_openmp_runtime():
    d = openmp.decide("/torch.libs/libgomp-a34b3233.so.1", x86=True, libiomp=LIB, opt_in=True)
    assert not d.on and "libgomp" in d.reason and "libiomp" not in d.ld_preload


def test_find_libiomp_looks_under_prefix_lib(tmp_path):
    assert openmp.find_libiomp([str(tmp_path)]) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert openmp.find_libiomp([str(tmp_path)]) == str(tmp_path / "lib" / "libiomp5.so")


def test_engine_args_hook_sets_ld_preload_for_our_speculative_engines(monkeypatch, caplog):
    """Through the plugin's create_engine_config hook, as `LLM(...)` or `vllm serve` reach it:
    set before vLLM's CPU platform would preload libgomp, logged once."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_onlinespec.serving.compat import patches, vllm_config

    if not openmp.is_x86() or openmp.find_libiomp() is None:
        pytest.skip("needs x86 and the venv's libiomp5.so")
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv(openmp.OPT_IN_ENV, "1")
    monkeypatch.delenv(openmp.BLOCKTIME_ENV, raising=False)
    monkeypatch.setattr(patches, "_logged", set())
    assert not vllm_config.ours_requested(EngineArgs(model="x"))
    args = EngineArgs(model="x", additional_config={"onlinespec": {}})
    assert vllm_config.ours_requested(args)
    with caplog.at_level(logging.INFO, logger="vllm_onlinespec"):
        patches.preload_intel_openmp()
        patches.preload_intel_openmp()
    assert os.environ["LD_PRELOAD"].count("libiomp5.so") == 1
    # the engine core and API server, which load it too, do not spin its threads
    assert os.environ[openmp.BLOCKTIME_ENV] == "0"
    # One record (a handler may see it twice when vLLM's handlers also reach caplog's).
    lines = list({id(r): r.getMessage() for r in caplog.records
                  if "Intel OpenMP" in r.getMessage()}.values())
    assert len(lines) == 1 and " on: " in lines[0], lines


def test_a_users_blocktime_is_kept(monkeypatch):
    if not openmp.is_x86() or openmp.find_libiomp() is None:
        pytest.skip("needs x86 and the venv's libiomp5.so")
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv(openmp.BLOCKTIME_ENV, "7")
    monkeypatch.setenv(openmp.OPT_IN_ENV, "1")
    assert openmp.apply_for_speculative_engine().on
    assert os.environ[openmp.BLOCKTIME_ENV] == "7"


def test_no_blocktime_without_the_preload(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.delenv(openmp.BLOCKTIME_ENV, raising=False)
    monkeypatch.delenv(openmp.OPT_IN_ENV, raising=False)  # the default
    d = openmp.apply_for_speculative_engine()
    assert not d.on and "libgomp" in d.reason and os.environ["LD_PRELOAD"] == ""
    assert openmp.BLOCKTIME_ENV not in os.environ
