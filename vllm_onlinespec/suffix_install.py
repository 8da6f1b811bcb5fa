"""Installs vLLM's suffix decoding backend (`speculative_config={"method": "suffix"}`) into this
Python environment (`make setup` runs it): `python -m vllm_onlinespec.suffix_install`.

vLLM 0.32's SuffixDecodingProposer (vllm/v1/spec_decode/suffix_decoding.py) imports
`arctic_inference.suffix_decoding.SuffixDecodingCache` from Snowflake's arctic-inference, and its
config check asks for `arctic-inference==0.1.1`. PyPI has that package only as an sdist whose full
build wants torch==2.7.0 in its build environment (build isolation fetches a CUDA torch), builds
custom ops, and registers a vLLM general plugin (entry point `arctic_inference`, written for vLLM
0.9/0.10) that would patch our engine. We need none of that. This script downloads the pinned
sdist with pip (sha256-checked), builds only its `csrc/suffix_decoding` extension (two C++ files,
nanobind, no torch) with CMake, and installs a minimal `arctic_inference` distribution:
`arctic_inference/__init__.py`, `arctic_inference/suffix_decoding/{__init__,cache}.py` and the
`_C` extension, plus a dist-info with NO entry points, so vLLM's plugin loader never sees an
arctic plugin (`pip uninstall arctic-inference` removes it cleanly).

Idempotent: a no-op when this install is present and imports. It refuses to overwrite an
arctic-inference installed by other means unless given --force. Needs a C++20 compiler, the
Python headers, `make`, and a package index (PyPI) for the sdist and nanobind (or --sdist PATH);
CMake comes from PATH when >= 3.18, else from a pip wheel. Errors end in one line on stderr.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.1.1"  # what vLLM 0.32 names; its suffix code is identical to 0.3.0 (latest)
SDIST = f"arctic_inference-{VERSION}.tar.gz"
SDIST_SHA256 = "36857e2fbe3ead34821a04be98dfab95086050c1e38199c8fdfe308234fdcf63"
NANOBIND = "nanobind==2.9.2"  # the sdist's own build-system pin
CMAKE = "cmake>=3.18,<4"  # only when no CMake >= 3.18 is on PATH (CMakeLists asks for 3.18)
INSTALLER = "vllm-onlinespec suffix_install"
DIST_INFO = f"arctic_inference-{VERSION}.dist-info"
# Taken from the sdist (relative to its top folder) -> installed path (relative to site-packages).
SOURCES = {
    "arctic_inference/suffix_decoding/__init__.py": "arctic_inference/suffix_decoding/__init__.py",
    "arctic_inference/suffix_decoding/cache.py": "arctic_inference/suffix_decoding/cache.py",
    "LICENSE": f"{DIST_INFO}/licenses/LICENSE",
}
TOP_INIT = f'''# Copyright 2025 Snowflake Inc.
# SPDX-License-Identifier: Apache-2.0
"""Minimal arctic_inference {VERSION}: only `arctic_inference.suffix_decoding`, built from the
PyPI sdist by vllm_onlinespec.suffix_install (no custom ops, no vLLM plugin)."""

__version__ = "{VERSION}"
'''


class InstallError(RuntimeError):
    pass


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _dist() -> md.Distribution | None:
    try:
        return md.distribution("arctic-inference")
    except md.PackageNotFoundError:
        return None


def _ours(dist: md.Distribution | None) -> bool:
    return dist is not None and (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def arctic_plugins() -> list[str]:
    """vllm.general_plugins entry points that arctic-inference registered (should be none)."""
    return [f"{ep.name} = {ep.value}" for ep in md.entry_points(group="vllm.general_plugins")
            if "arctic" in ep.name.lower() or ep.value.startswith("arctic_inference")]


def status() -> str | None:
    """None when our install of VERSION is present, imports and adds no plugin; else why not."""
    dist = _dist()
    if dist is None:
        return "arctic-inference not installed"
    if not _ours(dist):
        return f"arctic-inference {dist.version} installed by other means"
    if dist.version != VERSION:
        return f"arctic-inference {dist.version} installed, want {VERSION}"
    if plugins := arctic_plugins():
        return f"arctic vLLM plugin registered: {plugins}"
    try:
        importlib.invalidate_caches()
        mod = importlib.import_module("arctic_inference.suffix_decoding")
        mod.SuffixDecodingCache(max_tree_depth=4, max_cached_requests=1)
    except Exception as e:  # a stale or foreign build: rebuild
        return f"arctic_inference.suffix_decoding does not import ({type(e).__name__}: {e})"
    return None


def _run(cmd: list[str], what: str, **kw) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        lines = [ln.strip() for ln in (p.stderr + "\n" + p.stdout).splitlines() if ln.strip()]
        errs = [ln for ln in lines if re.search(r"error|not found|could not", ln, re.I)]
        raise InstallError(f"{what} failed (exit {p.returncode}): "
                           f"{(errs or lines or ['no output'])[-1][:400]}")
    return p.stdout


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def download_sdist(dest: Path) -> Path:
    # --no-build-isolation: pip reads the sdist's metadata, and with isolation it would first
    # install the build requirements (a CUDA torch 2.7); here it only imports setuptools + torch.
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
          f"arctic-inference=={VERSION}", "-d", str(dest)],
         f"pip download arctic-inference=={VERSION}")
    p = dest / SDIST
    if not p.is_file():
        raise InstallError(f"pip download left no {SDIST} in {dest}: {sorted(os.listdir(dest))}")
    return p


def extract(sdist: Path, dest: Path) -> Path:
    if (got := _sha256(sdist)) != SDIST_SHA256:
        raise InstallError(f"{sdist} has sha256 {got}, want {SDIST_SHA256}")
    top = f"arctic_inference-{VERSION}/"
    want = {top + s for s in SOURCES}
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and (
            m.name in want or m.name.startswith(top + "csrc/suffix_decoding/"))]
        if missing := want - {m.name for m in members}:
            raise InstallError(f"{sdist} lacks {sorted(missing)}")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, members=members, **kw)
    return dest / top


def _cmake_version(exe: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ()
    m = re.search(r"version (\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else ()


def build_tools(dest: Path) -> tuple[str, dict[str, str]]:
    """nanobind (pinned) in a private folder; CMake from PATH if new enough, else a pip wheel."""
    pkgs = [NANOBIND]
    cmake = shutil.which("cmake")
    if not cmake or _cmake_version(cmake) < (3, 18):
        pkgs.append(CMAKE)
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(dest), *pkgs],
         f"pip install {' '.join(pkgs)}")
    if CMAKE in pkgs:
        cmake = str(dest / "cmake" / "data" / "bin" / "cmake")  # the wheel's binary, not its shim
        if not _cmake_version(cmake):
            raise InstallError(f"pip's {CMAKE} left no working {cmake}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(dest), env.get("PYTHONPATH")]))
    return cmake, env


def build_extension(src: Path, build: Path, cmake: str, env: dict[str, str]) -> Path:
    """CMake-builds csrc/suffix_decoding into `_C<EXT_SUFFIX>` (nanobind, linked statically)."""
    _run([cmake, "-S", str(src / "csrc/suffix_decoding"), "-B", str(build),
          "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
         "cmake configure of csrc/suffix_decoding", env=env)
    _run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 1)],
         "cmake build of csrc/suffix_decoding", env=env)
    ext = build / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not ext.is_file():
        raise InstallError(f"the build made no {ext.name}: {sorted(os.listdir(build))}")
    return ext


def _record_line(site: Path, rel: str) -> str:
    data = (site / rel).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def _dist_dir(dist: md.Distribution) -> Path:
    for f in dist.files or []:
        if f.name == "METADATA":
            return Path(dist.locate_file(f)).parent
    raise InstallError(f"arctic-inference {dist.version} has no RECORD; remove it by hand")


def remove_ours(site: Path, dist: md.Distribution) -> None:
    """Deletes the files our RECORD lists, their caches, then the folders left empty."""
    info = _dist_dir(dist)
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if p.is_file() or p.is_symlink():
            p.unlink()
    pkg = site / "arctic_inference"
    for d in (pkg / "suffix_decoding/__pycache__", pkg / "__pycache__"):
        shutil.rmtree(d, ignore_errors=True)
    for d in (pkg / "suffix_decoding", pkg, info / "licenses", info):
        try:
            d.rmdir()
        except OSError:
            pass


def install_files(site: Path, src: Path, ext: Path) -> list[str]:
    """Writes the package, then the dist-info last (an interrupted install reads as absent)."""
    pkg = site / "arctic_inference"
    if pkg.exists():
        raise InstallError(f"{pkg} exists but belongs to no arctic-inference dist-info; remove it")
    files = {"arctic_inference/__init__.py": TOP_INIT.encode()}
    files.update({dst: (src / s).read_bytes() for s, dst in SOURCES.items()})
    files[f"arctic_inference/suffix_decoding/{ext.name}"] = ext.read_bytes()
    files[f"{DIST_INFO}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: arctic_inference\nVersion: {VERSION}\n"
        f"Summary: arctic_inference.suffix_decoding only, built from the arctic-inference {VERSION}"
        " sdist by vllm_onlinespec.suffix_install (no custom ops, no vLLM plugin)\n"
        "License: Apache-2.0\nRequires-Dist: numpy\n").encode()
    files[f"{DIST_INFO}/INSTALLER"] = f"{INSTALLER}\n".encode()
    for rel, data in sorted(files.items(), key=lambda kv: kv[0].startswith(DIST_INFO)):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    os.chmod(site / f"arctic_inference/suffix_decoding/{ext.name}", 0o755)
    record = [_record_line(site, rel) for rel in files] + [f"{DIST_INFO}/RECORD,,"]
    (site / DIST_INFO / "RECORD").write_text("\n".join(record) + "\n")
    return sorted(files)


def verify(site: Path) -> None:
    """In a fresh interpreter: imports from `site`, speculates a repeated prompt, no plugin."""
    code = (
        "import importlib.metadata as md, numpy as np, arctic_inference as a\n"
        "from arctic_inference.suffix_decoding import SuffixDecodingCache\n"
        f"assert a.__file__.startswith({str(site)!r}), a.__file__\n"
        "c = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=16)\n"
        "prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]\n"
        "c.start_request('r', np.array(prompt, dtype=np.int32))\n"
        "c.add_active_response('r', [4])\n"
        "d = c.speculate('r', np.array(prompt + [4], dtype=np.int32), max_spec_tokens=4)\n"
        "assert d.token_ids == [5, 6, 7, 8], d.token_ids\n"
        "c.stop_request('r')\n"
        "bad = [e for e in md.entry_points(group='vllm.general_plugins') if 'arctic' in e.value]\n"
        "assert not bad, bad\n"
    )
    _run([sys.executable, "-c", code], "verification of the installed arctic_inference")


def install(sdist: Path | None = None, force: bool = False, quiet: bool = False) -> str:
    why = status()
    if why is None and not force:
        return f"arctic_inference {VERSION} (suffix decoding only) already installed; nothing to do"
    why = why or "--force"
    t0 = time.monotonic()
    site = _site()
    dist = _dist()
    if dist is not None and not _ours(dist):
        if not force:
            raise InstallError(f"{why} (in {dist.locate_file('')}); it may register a vLLM "
                               "plugin for older vLLM: `pip uninstall arctic-inference` or rerun "
                               "with --force")
        _run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "arctic-inference"],
             "pip uninstall arctic-inference")
    if not quiet:
        print(f"suffix_install: {why}; building arctic_inference {VERSION} suffix_decoding",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="suffix-install-") as tmp:
        tmp = Path(tmp)
        if sdist is None:
            sdist = download_sdist(tmp / "dl")
        src = extract(Path(sdist), tmp / "src")
        cmake, env = build_tools(tmp / "tools")
        ext = build_extension(src, tmp / "build", cmake, env)
        importlib.invalidate_caches()
        if (dist := _dist()) is not None and _ours(dist):
            remove_ours(site, dist)
        files = install_files(site, src, ext)
    importlib.invalidate_caches()
    try:
        verify(site)
    except InstallError:
        if (dist := _dist()) is not None and _ours(dist):
            remove_ours(site, dist)  # so that the next run rebuilds instead of skipping
        raise
    return (f"installed arctic_inference {VERSION} (suffix decoding only: {len(files)} files, "
            f"no vLLM plugin) into {site} in {time.monotonic() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_onlinespec.suffix_install",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, help=f"use this {SDIST} instead of downloading it")
    ap.add_argument("--force", action="store_true",
                    help="replace an arctic-inference installed by other means (or rebuild ours)")
    ap.add_argument("--check", action="store_true", help="only report; exit 1 when not installed")
    a = ap.parse_args(argv)
    if a.check:
        why = status()
        print(f"suffix_install: {why or f'arctic_inference {VERSION} installed'}")
        return 1 if why else 0
    try:
        print(f"suffix_install: {install(a.sdist, force=a.force)}")
    except Exception as e:
        kind = "" if isinstance(e, InstallError) else f"{type(e).__name__}: "
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"suffix_install: error: {kind}{msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
