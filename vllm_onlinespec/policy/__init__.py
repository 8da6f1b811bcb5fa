"""How much of each draft the target verifies (no vLLM import here).

    verify_length.py   per-request verify-length policies (fixed, adaflash, budget) and the
                       online per-position acceptance statistics
    budget.py          the target step's cost model and the batch verify-token allocator
    cutter.py          the draft cutter: length head -> policy -> cut, one object per engine
"""
