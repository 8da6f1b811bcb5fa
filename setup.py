"""Package discovery: every subpackage of vllm_onlinespec ships without being listed by hand, and
the top-level kernels/ ships as vllm_onlinespec.kernels (pyproject.toml's package-dir maps it;
`packages.find` alone cannot see a mapped folder). Everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

# Namespace discovery also lists the data folders (drafters/, adapters/), so the shipped drafter
# and adapter files install as package data rather than as an ambiguous non-package folder.
found = find_namespace_packages(include=["vllm_onlinespec", "vllm_onlinespec.*"],
                                exclude=["*.__pycache__"])
setup(packages=[*found, "vllm_onlinespec.kernels"])
