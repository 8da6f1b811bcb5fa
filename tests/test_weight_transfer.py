"""vLLM's weight-transfer engine (start_weight_update, update_weights chunks,
finish_weight_update: the NCCL / CUDA-IPC path RL frameworks push a new policy through) and the
learner: after a target update the learner follows as after a swap; a drafter update is refused
while the learner owns the drafter's weights. vLLM's own methods are faked here (its transfer
engines need CUDA); the session is the real one."""

import threading

import pytest

from test_gpu_path import _runner


def held_elsewhere(lock) -> bool:
    """Whether another thread holds `lock` (the learner's model lock: no update can run)."""
    got = []

    def probe():
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return not got[0]


@pytest.fixture
def worker(tmp_path, monkeypatch):
    from test_learner_factory import H, V, write_drafter
    from vllm_onlinespec.serving.session import OnlineSession
    from vllm_onlinespec.serving.validate import config_from_vllm
    from vllm_onlinespec.serving.worker import SpecDecodeWorker

    runner = _runner(write_drafter(tmp_path / "d", block_size=4), V, H)
    session = OnlineSession(runner, config_from_vllm(runner.vllm_config))
    runner._onlinespec = session
    calls = []
    base = SpecDecodeWorker.__mro__[1]
    monkeypatch.setattr(base, "finish_weight_update",
                        lambda w: calls.append(("finish", held_elsewhere(session.learner._model_lock))),
                        raising=False)
    monkeypatch.setattr(base, "start_draft_weight_update", lambda w: calls.append("draft"),
                        raising=False)
    w = object.__new__(SpecDecodeWorker)
    w.model_runner = runner
    yield w, session, calls
    session.close()


def test_the_learner_follows_a_pushed_target(worker):
    w, session, calls = worker
    w._weight_update_is_draft = False
    w.finish_weight_update()
    assert calls == [("finish", True)]  # vLLM's finish ran with the learner paused
    assert session.target_swaps == 1


def test_a_drafter_update_is_left_to_vllm_or_refused_while_learning(worker):
    w, session, calls = worker
    w._weight_update_is_draft = True
    w.finish_weight_update()
    assert calls == [("finish", False)] and session.target_swaps == 0
    with pytest.raises(RuntimeError, match=r"learner owns the drafter's weights.*enabled = false"):
        w.start_draft_weight_update()
    assert calls == [("finish", False)]  # vLLM's start never ran
