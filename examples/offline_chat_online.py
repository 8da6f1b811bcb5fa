"""Offline `LLM.chat` with DFlash speculation and online learning on (CPU, SmolLM2-135M).

    python examples/offline_chat_online.py [--max-tokens 128] [--drafter DIR]

Three rounds of new chat prompts go through one engine. After every step the worker turns the
target's verification into training data, a learner thread updates its copy of the drafter and
publishes new weights into vLLM's drafter between steps (the "drafter version"). Greedy output is
what the target alone would write: speculation never changes it.
"""

from __future__ import annotations

import argparse
import time

from _drafter import PRESET, default_drafter, num_speculative_tokens

ROUNDS = [
    ["Give me three tips for a good night's sleep.", "Why is the sky blue?",
     "Write a haiku about rain."],
    ["List five healthy breakfast ideas.", "How do vaccines work?",
     "Write a short thank-you note to a friend."],
    ["What should I pack for a weekend hike?", "Explain what a black hole is.",
     "Write a limerick about a cat."],
]
# The recommended CPU configuration (vllm_onlinespec/presets.py). One departure, so that nine
# short answers show a publish: every update is published (the preset publishes every 4th, each
# publish re-packing vLLM's drafter on the engine thread).
ONLINE = {"preset": PRESET, "publish": {"every_n_updates": 1}}


def spec_counters(llm) -> tuple[float, float]:
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    return (m.get("vllm:spec_decode_num_accepted_tokens", 0.0),
            m.get("vllm:spec_decode_num_drafts", 0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafter", help="DFlash drafter folder (default: the shipped one)")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import pull
    from vllm_onlinespec.serving_dtype import resolve_dtype
    from vllm_onlinespec.serving.stats import fetch

    target = str(pull("smollm2-135m"))
    drafter = args.drafter or default_drafter()
    k = num_speculative_tokens()
    # bfloat16 where the hardware computes it natively, else float32 (an AVX2 CPU emulates bf16).
    llm = LLM(model=target, dtype=resolve_dtype("auto"), **engine_kwargs(), disable_log_stats=False,
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": k},
              # The "onlinespec" key alone selects vllm_onlinespec's worker.
              additional_config={"onlinespec": ONLINE})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, prompts in enumerate(ROUNDS, 1):
        a0, d0 = spec_counters(llm)
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params,
                        use_tqdm=False)
        dt = time.perf_counter() - t0
        a1, d1 = spec_counters(llm)
        st = fetch(llm)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        al = (a1 - a0 + d1 - d0) / (d1 - d0) if d1 > d0 else 1.0
        print(f"round {i}: {n} tokens in {dt:.1f} s, acceptance length {al:.2f} "
              f"({d1 - d0:.0f} verify steps with drafts, K = {k}), drafter version {st.published_version}, learner updates "
              f"{st.learner.updates}")
        for q, o in zip(prompts, outs):
            print(f"  >>> {q}\n  {o.outputs[0].text.strip()[:200]!r}")
    # The learner trains on the last round's feedback after it was served; give it a moment.
    deadline = time.time() + 30
    while time.time() < deadline:
        st = fetch(llm)
        if st.learner.caught_up:  # too little fresh feedback left for another update
            break
        time.sleep(0.5)
    print(f"final: drafter version {st.published_version}, learner updates "
          f"{st.learner.updates}, last loss {st.learner.last_loss:.3f}, "
          f"hook errors {st.hook_errors}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
