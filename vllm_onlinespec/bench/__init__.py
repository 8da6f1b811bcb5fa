"""Benchmarks: arms of one vLLM engine each, served one after the other on the same prompt
stream, a report (JSON, markdown, PNG), the domain-shift and concurrency benchmarks, the demo.

    prompts.py     prompt streams (Spec-Bench categories, HumanEval, built-in chat prompts,
                   prompt files: prompt / OpenAI messages / ShareGPT JSONL)
    arrivals.py    arrival processes: closed loop of C clients, Poisson open loop; asyncio driver
    engine_loop.py one engine served request by request as clients arrive (the continuous
                   protocols), probes of its counters per window, the windows (pure)
    arm_catalog.py arm names -> ArmSpec (nospec, ngram, frozen, online-<algo>, fixed/adaflash/budget)
    arm_process.py `python -m vllm_onlinespec.bench.arm_process SPEC.json`: one engine, one
                   stream, one result (the subprocess of one arm), waves or continuous
    launch.py      launches the arms' subprocesses one after the other, with progress bars
    drafters.py    trains (or reuses) a starting drafter through `vllm-onlinespec train`
    report.py      summary table, markdown, plots
    cli.py         `vllm-onlinespec bench`
    concurrency.py `vllm-onlinespec bench-serve`: `vllm serve` + `vllm bench serve` at several C
    demo.py        `vllm-onlinespec demo`

Nothing here imports vLLM at module level: engines live in subprocesses (`arm_process.py`, `vllm serve`).
"""
