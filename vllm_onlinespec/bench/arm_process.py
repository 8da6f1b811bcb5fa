"""One benchmark arm: one vLLM engine serving one prompt stream.

    python -m vllm_onlinespec.bench.arm_process SPEC.json

Two stream protocols; in both, every prompt is served exactly once, in file order, and a
request's acceptance is measured while it is served, so it reflects what the learner had
learned from earlier requests only: learning from past traffic to serve future traffic, never
memory of the same prompts.

    waves       `wave` prompts at a time (one batched `llm.chat` call per wave), optionally a
                pause after each for the learner (`catch_up_s`, reported apart).
    continuous  `arrivals` = closed:C or poisson:RATE: requests join the running batch as
                clients send them (bench/engine_loop.py), the learner trains beside serving,
                the wall time is the whole stream; windows of `window_s` take the waves' place.

Progress goes to stdout as `@@bench {json}` lines (the runner turns them into a progress bar);
the result JSON is rewritten after every wave, so a crash keeps what was measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from vllm_onlinespec.bench.results import ArmResult, ArmSpec, RequestResult, WaveResult
from vllm_onlinespec.serving.stats import OnlineSpecStats, fetch

PROGRESS_TAG = "@@bench "
SPEC_COUNTERS = {"accepted": "vllm:spec_decode_num_accepted_tokens",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "drafts": "vllm:spec_decode_num_drafts"}


def progress(event: str, **kw) -> None:
    print(PROGRESS_TAG + json.dumps({"event": event, **kw}), flush=True)


def load_prompts(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_llm(spec: ArmSpec):
    from vllm_onlinespec.engine import SAME_RUNNER_ENV, engine_kwargs

    os.environ.update(SAME_RUNNER_ENV)  # before vLLM reads it: every arm on the same runner
    from vllm import LLM

    kw = engine_kwargs(max_model_len=spec.max_model_len)
    if spec.method != "none":
        kw["speculative_config"] = spec.speculative_config
        kw["per_request_spec_decode_metrics"] = "summary"
    if spec.onlinespec is not None:
        kw["additional_config"] = {"onlinespec": spec.onlinespec}
    return LLM(model=spec.target, dtype=spec.dtype, disable_log_stats=False, **kw)


def spec_counters(llm) -> dict[str, int]:
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return {k: int(found.get(name, 0)) for k, name in SPEC_COUNTERS.items()}


def onlinespec_stats(llm, spec: ArmSpec) -> OnlineSpecStats:
    """The worker's stats, parsed; defaults (version 0, no learner) for arms without ours."""
    if spec.onlinespec is None:
        return OnlineSpecStats()
    return fetch(llm)


def step_profile(llm, spec: ArmSpec) -> dict:
    """The worker's per-phase time over the arm ({} for arms on vLLM's own worker)."""
    if spec.onlinespec is None:
        return {}
    return llm.collective_rpc("onlinespec_step_profile")[0]


def request_result(o, index: int, prompt: dict, wave: int, version: int) -> RequestResult:
    comp = o.outputs[0]
    n = len(comp.token_ids)
    tpot = float("nan")
    m = getattr(o, "metrics", None)
    if m is not None and n > 1 and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0):
        tpot = (m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3
    al = None
    sdm = getattr(comp, "spec_decode_metrics", None)
    if sdm is not None:
        al = float(sdm.to_dict()["mean_acceptance_length"])
    return RequestResult(index=index, prompt_id=prompt.get("id", str(index)),
                         category=prompt.get("category", ""), wave=wave, output_tokens=n,
                         tpot_ms=tpot, acceptance_length=al, drafter_version=version)


def catch_up(llm, spec: ArmSpec) -> float:
    """Pause (at most spec.catch_up_s) until the learner has trained on this wave's feedback."""
    if spec.catch_up_s <= 0 or not spec.learning:
        return 0.0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < spec.catch_up_s:
        # caught_up: fewer trainable fresh tokens than one update needs (holdback excluded).
        learner = onlinespec_stats(llm, spec).learner
        if learner is None or learner.caught_up:
            break
        time.sleep(0.25)
    return time.perf_counter() - t0


def run(spec: ArmSpec) -> ArmResult:
    from vllm import SamplingParams

    res = ArmResult(spec=spec)
    prompts = load_prompts(spec.prompts)
    t0 = time.perf_counter()
    llm = make_llm(spec)
    res.startup_s = time.perf_counter() - t0
    progress("started", startup_s=res.startup_s, prompts=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens)
    try:
        (serve_continuous if spec.arrivals else serve_waves)(llm, spec, prompts, params, res)
        res.learner = onlinespec_stats(llm, spec).to_dict() if spec.onlinespec is not None else {}
        res.step_profile = step_profile(llm, spec)
    finally:
        res.save()
        try:
            llm.llm_engine.engine_core.shutdown()  # stops the engine and worker processes now
        except Exception:  # noqa: BLE001 - the result is saved; exiting cleans up the rest
            pass
    return res


def swap_weights(llm, spec: ArmSpec) -> dict:
    """Replace the target's weights by spec.swap_to's in the running engine: this project's
    worker through `swap_target` (the learner follows), vLLM's own workers through vLLM's
    in-place reload (the peers face the same change)."""
    t0 = time.perf_counter()
    if spec.onlinespec is not None:
        from vllm_onlinespec.serving.target_swap import swap_target

        report = swap_target(llm, spec.swap_to)
    else:
        from vllm_onlinespec.serving.target_swap import reset_prefix_cache

        llm.collective_rpc("reload_weights", kwargs={"weights_path": spec.swap_to})
        report = {"prefix_cache_reset": reset_prefix_cache(llm)}
    return {"seconds": time.perf_counter() - t0,
            "dropped_tokens": int(report.get("dropped_tokens", 0))}


def serve_continuous(llm, spec: ArmSpec, prompts: list[dict], params, res: ArmResult) -> None:
    """The stream under spec.arrivals, nothing paused or left out: res.serve_s is from the
    first request sent to the last one finished, res.waves are windows of spec.window_s."""
    from vllm_onlinespec.bench import arrivals as A
    from vllm_onlinespec.bench.engine_loop import EngineLoop, version_at, windows

    process = A.parse_arrivals(spec.arrivals, seed=spec.arrival_seed)
    tok = llm.get_tokenizer()
    # Rendered before the clock starts, as llm.chat renders them: the chat template's text,
    # then its tokens without special tokens added again.
    ids = [tok.encode(tok.apply_chat_template(p["messages"], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)
           for p in prompts]

    def probe() -> tuple[int, int, int, int, int]:
        c = spec_counters(llm)
        st = onlinespec_stats(llm, spec)
        return (c["drafts"], c["draft_tokens"], c["accepted"], st.published_version,
                st.learner.updates if st.learner else 0)

    loop = EngineLoop(llm.llm_engine, params, probe, window_s=spec.window_s).start()
    sent = 0

    def submit(x):
        nonlocal sent
        sent += 1
        if spec.swap_at and sent == spec.swap_at:
            # Between two engine steps, on the loop's thread; no request is sent until it is done.
            t = loop.now()
            res.swap = {"request": sent, "t_s": t, "to": spec.swap_to,
                        **loop.between_steps(lambda: swap_weights(llm, spec)).result()}
            progress("swap", seconds=round(res.swap["seconds"], 2))
        fut = loop.submit(x)
        fut.add_done_callback(lambda f: progress("request", ok=f.exception() is None))
        return fut

    try:
        records = A.run(process, ids, submit)
    finally:
        probes = loop.close()
    for rec in records:
        i = rec.prompt_index
        if rec.error is not None:
            res.failed.append(f"{prompts[i].get('id', i)}: {rec.error}")
            continue
        fin = rec.result  # times on the engine loop's clock, like the probes'
        r = request_result(fin.output, rec.index, prompts[i], 0, version_at(probes, fin.submit_s))
        r.submit_s, r.finish_s = fin.submit_s, fin.finish_s
        res.requests.append(r)
    res.waves = windows(probes, res.requests)
    res.serve_s = probes[-1].t_s - probes[0].t_s  # = the windows' wall times added up
    if loop.error:
        raise RuntimeError(f"engine loop: {loop.error}")


def wave_params(params, spec: ArmSpec, first: int, n: int):
    """Greedy: the one SamplingParams. Sampled: one per request, seeded by its place in the
    stream, so every arm draws with the same seeds."""
    if spec.temperature <= 0:
        return params
    from vllm import SamplingParams

    return [SamplingParams(temperature=spec.temperature, top_p=1.0, seed=first + i,
                           max_tokens=spec.max_tokens) for i in range(n)]


def serve_waves(llm, spec: ArmSpec, prompts: list[dict], params, res: ArmResult) -> None:
    n_waves = -(-len(prompts) // spec.wave)
    for w in range(n_waves):
        batch = prompts[w * spec.wave:(w + 1) * spec.wave]
        st0 = onlinespec_stats(llm, spec)
        c0 = spec_counters(llm)
        t = time.perf_counter()
        outs = llm.chat([p["messages"] for p in batch],
                        wave_params(params, spec, w * spec.wave, len(batch)), use_tqdm=False)
        wall = time.perf_counter() - t
        c1 = spec_counters(llm)
        st1 = onlinespec_stats(llm, spec)
        v0 = st0.published_version
        reqs = [request_result(o, w * spec.wave + i, p, w, v0)
                for i, (o, p) in enumerate(zip(outs, batch))]
        res.requests += reqs
        tpots = [r.tpot_ms for r in reqs if r.tpot_ms == r.tpot_ms]
        wr = WaveResult(index=w, prompts=len(batch),
                        output_tokens=sum(r.output_tokens for r in reqs), wall_s=wall,
                        **{k: c1[k] - c0[k] for k in SPEC_COUNTERS},
                        tpot_ms=sum(tpots) / len(tpots) if tpots else float("nan"),
                        version_start=v0, version_end=st1.published_version,
                        learner_updates=st1.learner.updates if st1.learner else 0)
        wr.catch_up_s = catch_up(llm, spec)
        res.waves.append(wr)
        res.serve_s += wall
        res.save()
        progress("wave", index=w, prompts=len(batch), acceptance_length=wr.acceptance_length,
                 tok_s=wr.tok_s, version=wr.version_end)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m vllm_onlinespec.bench.arm_process SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = ArmSpec(**json.load(f))
    for k, v in spec.env.items():
        os.environ[k] = str(v)
    try:
        run(spec)
    except Exception as e:  # noqa: BLE001 - the runner reads the error from the result file
        traceback.print_exc()
        res = ArmResult.load(spec.out) if os.path.exists(spec.out) else ArmResult(spec=spec)
        res.error = f"{type(e).__name__}: {e}"
        res.save()
        progress("error", error=res.error)
        return 1
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
