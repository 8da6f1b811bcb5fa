"""vLLM speculative decoding whose DFlash drafter keeps learning while it serves.

`vllm_onlinespec.SpecDecodeWorker` is resolved lazily, so importing this package stays cheap
(vLLM imports it in every process through the general plugin).
"""

import os as _os

__version__ = "0.1.0"
__all__ = ["SpecDecodeWorker", "push_target", "swap_target", "__version__"]

# `vllm_onlinespec.kernels` is the checkout's top-level kernels/ (pyproject's package-dir maps it
# at install time). Run from a source checkout (PYTHONPATH=<repo>, no install: the GPU machine,
# or a git worktree beside an editable install of another checkout) nothing maps it, or the
# install maps it to the *other* checkout's kernels/. Searching the checkout root too makes
# `vllm_onlinespec.kernels` this checkout's kernels/; PathFinder runs before setuptools'
# editable finder, so this wins. An installed wheel has kernels/ inside the package: unchanged.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "kernels"))
        and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py"))
        and _os.path.isfile(_os.path.join(_root, "pyproject.toml"))):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
del _here, _root


def __getattr__(name: str):
    if name == "SpecDecodeWorker":
        from vllm_onlinespec.serving.worker import SpecDecodeWorker

        return SpecDecodeWorker
    if name in ("swap_target", "push_target"):
        from vllm_onlinespec.serving import target_swap

        return getattr(target_swap, name)
    raise AttributeError(f"module 'vllm_onlinespec' has no attribute {name!r}")
