"""`vllm-onlinespec bench-soak` on a short run: `vllm serve` with the cpu preset learning under
the soak's whole mix (greedy, sampled, seeded, n = 2, a prompt near max_model_len, streamed,
dropped mid-stream, and malformed requests), a target swap at half time, then SIGKILL during a
learner update and during a checkpoint write, each followed by a restart with the same command.
Nothing well-formed fails, every malformed request gets a 4xx, every greedy answer equals the
target's own greedy continuation (float32), the restarted server resumes the newest complete
checkpoint and serves exactly its drafter, and SIGINT exits cleanly."""

import json

import pytest

pytestmark = pytest.mark.vllm


def test_a_short_soak_with_a_swap_and_two_kills(smollm2_path, tmp_path):
    from vllm_onlinespec.cli import main
    from vllm_onlinespec.models import pull

    pull("smollm2-135m-terse")
    # Updates publish and checkpoint at once (every update): a short run reaches both kills.
    rc = main(["bench-soak", "--duration", "75", "--concurrency", "3", "--max-tokens", "24",
               "--max-model-len", "1024", "--malformed-every", "4",
               "--online", json.dumps({"publish": {"every_n_updates": 1},
                                       "min_new_tokens_per_update": 8}),
               "--out", str(tmp_path / "run")])
    result = json.loads((tmp_path / "run" / "soak.json").read_text())
    s = result["summary"]
    assert s["failed_wellformed"] == 0, result["failures"]
    assert s["malformed_total"] >= 4 and s["malformed_4xx"] == s["malformed_total"], \
        s["malformed_statuses"]
    assert s["wellformed"] >= 10 and s["aborted_by_client"] >= 0
    assert s["swap"]["ok"], s["swap"]
    g = s["greedy"]
    assert g["compared"] >= 3 and g["mismatches"] == 0, g
    assert s["learner_errors"] == 0 and s["hook_errors"] == 0
    # A checkpoint write may end between seeing it and the kill: the soak tries again (3 times).
    caught = [k for k in s["kills"] if k["caught"]]
    assert [k["moment"] for k in caught] == ["update", "checkpoint"], s["kills"]
    for k in s["kills"]:  # every restart, caught there or not, resumed the newest checkpoint
        assert k["answered"] and k["digest_equal"], k
        assert k["resumed_version"] == k["newest_complete"] is not None, k
        assert any("resumed drafter version" in line for line in k["said"]), k
    assert result["stop_exit_code"] == 0
    assert rc == 0
    assert (tmp_path / "run" / "soak.md").is_file() and (tmp_path / "run" / "soak.png").is_file()
