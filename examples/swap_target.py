"""Swap the target's weights in a running engine, as an RL loop or a fine-tuning job would, and
let the online learner follow: serve SmolLM2-135M-Instruct, swap in its terse-steps fine-tune
(`vllm-onlinespec model pull smollm2-135m-terse`: a LoRA merged into the base), serve again.

    python examples/swap_target.py [--max-tokens 64]
"""

import argparse

from vllm import LLM, SamplingParams

from vllm_onlinespec import swap_target
from vllm_onlinespec.engine import engine_kwargs
from vllm_onlinespec.models import pull, shipped_drafter
from vllm_onlinespec.presets import PRESET_K
from vllm_onlinespec.serving_dtype import resolve_dtype
from vllm_onlinespec.serving.stats import fetch

QUESTIONS = ["How do plants make food?", "Why is the sky blue?", "How does a bicycle stay upright?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    base, changed = str(pull("smollm2-135m")), str(pull("smollm2-135m-terse"))
    # bfloat16 where the CPU computes it natively, float32 elsewhere (emulated bf16 is ~2.6x slower)
    llm = LLM(model=base, dtype=resolve_dtype("auto"), **engine_kwargs(max_model_len=1024),
              speculative_config={"method": "dflash", "model": str(shipped_drafter("smollm2-135m")),
                                  "num_speculative_tokens": PRESET_K["cpu"]},
              additional_config={"onlinespec": {"preset": "cpu"}})  # vllm_onlinespec/presets.py
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for phase in ("base", "swapped"):
        if phase == "swapped":
            report = swap_target(llm, changed)  # one call; a bad folder is one line, nothing changes
            print(f"swapped in {report['seconds']:.2f} s, {report['dropped_tokens']} stale "
                  f"feedback tokens dropped")
        outs = llm.chat(chats, params, use_tqdm=False)
        st = fetch(llm)
        print(f"--- {phase}: drafter version {st.published_version}, learner share "
              f"{st.learner.share:.2f} ({st.learner.share_reason or 'warming up'})")
        for q, o in zip(QUESTIONS, outs):
            print(f">>> {q}\n{o.outputs[0].text.strip()}\n")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
