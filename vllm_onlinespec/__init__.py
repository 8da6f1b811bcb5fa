"""vLLM speculative decoding whose DFlash drafter keeps learning while it serves."""
__version__ = "0.1.0"
