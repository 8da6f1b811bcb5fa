"""vLLM speculative decoding whose DFlash drafter keeps learning while it serves.

`vllm_onlinespec.SpecDecodeWorker` is resolved lazily, so importing this package stays cheap
(vLLM imports it in every process through the general plugin).
"""

__version__ = "0.1.0"
__all__ = ["SpecDecodeWorker", "__version__"]


def __getattr__(name: str):
    if name == "SpecDecodeWorker":
        from vllm_onlinespec.serving.worker import SpecDecodeWorker

        return SpecDecodeWorker
    raise AttributeError(f"module 'vllm_onlinespec' has no attribute {name!r}")
