"""``shardfmt drill -- <command>`` (issue 20, item 7): the kill-and-resume drill on a user's own
training script, unmodified: run uninterrupted, run killed between checkpoints, restarted; the
step lines it prints are compared."""

from __future__ import annotations

import os
import sys

import pytest

from shardfmt.cli import main as shardfmt_main
from shardfmt.demo.drill import compare, run_drill, step_lines

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "drill", "train.py")


def test_step_lines_and_compare_take_the_restarts_lines_for_the_steps_it_redid():
    import re

    rx = re.compile(r"\bstep\W{0,3}(?P<step>\d+)")
    a = step_lines("step 1 loss 1.5\nstep 2 loss 1.25\nstep 3 loss 1.0\nnoise\n", rx)
    assert a == {1: [(1.5,)], 2: [(1.25,)], 3: [(1.0,)]}
    killed = step_lines("step 1 loss 1.5\nstep 2 loss 1.25\nstep 3 loss 9.0\n", rx)  # 3: lost, redone
    restarted = step_lines("step 3 loss 1.0\n", rx)
    assert compare(a, killed, restarted, rtol=0, atol=0) == (2, [])
    assert compare(a, killed, step_lines("step 3 loss 1.0000001\n", rx), rtol=0, atol=0)[1]
    assert compare(a, killed, step_lines("step 3 loss 1.0000001\n", rx), rtol=1e-6, atol=0)[1] == []
    # shardfmt's own log lines name steps too ("restored step 2 in 0.1 s"): never the job's
    assert step_lines("INFO shardfmt: restored step 2 in 0.103 s\nstep 3 loss 1.0\n", rx) == {3: [(1.0,)]}


def _drill(tmp_path, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "0", "--monitor-interval", "0.2", SCRIPT, "--root", str(tmp_path / "ckpt"), *extra]
    return shardfmt_main(["drill", "--dir", str(tmp_path / "drill"), "--kill-at-save", "3", "--", *cmd])


@pytest.mark.slow
def test_the_drill_passes_a_resumable_script_bit_for_bit_and_fails_one_that_is_not(tmp_path, capsys):
    env = dict(OMP_NUM_THREADS="1", LOGLEVEL="ERROR", TORCH_CPP_LOG_LEVEL="ERROR")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert _drill(tmp_path / "good") == 0
        out = capsys.readouterr().out
        assert "killed after step 9 and resumed from step 6; steps 7..9 were lost and redone" in out
        assert "matches the uninterrupted one bit for bit: 12 steps compared" in out
        assert not (tmp_path / "good" / "ckpt").exists()  # the drill kept its checkpoints in its own directory
        assert sorted(os.listdir(tmp_path / "good" / "drill")) == ["A", "A.log", "B", "B.killed.log",
                                                                   "B.restarted.log"]
        assert _drill(tmp_path / "bad", "--forget-optimizer") == 1
        out = capsys.readouterr().out
        # step 7's loss comes from the restored weights (equal); the optimizer state was not saved: 8 on differ
        assert "differs from the uninterrupted one" in out and "step 8: run A printed" in out
        assert "step 7:" not in out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_drill_refuses_a_missing_command_and_a_kill_before_any_checkpoint(capsys):
    assert shardfmt_main(["drill", "--"]) == 2
    assert shardfmt_main(["drill", "--kill-at-save", "1", "--", "true"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_a_run_that_fails_is_reported_with_the_end_of_its_log(tmp_path, capsys):
    cmd = [sys.executable, "-c", "print('step 1 loss 0.5'); print('boom: the job failed'); raise SystemExit(3)"]
    assert run_drill(cmd, work=str(tmp_path / "w"), timeout=60) == 1
    out = capsys.readouterr().out
    assert "A exit 3" in out and "the last lines of run A (exit 3):" in out and "boom: the job failed" in out
    assert "the last lines of run B, killed" not in out  # it exited non-zero, as a killed run does


def test_a_rank_that_aborts_at_exit_is_reported_with_its_known_cause(tmp_path, capsys):
    script = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "  # no core file
              "print('step 1 loss 0.5', flush=True); "
              "sys.stderr.write('terminate called without an active exception\\n'); sys.stderr.flush(); os.abort()")
    assert run_drill([sys.executable, "-c", script], work=str(tmp_path / "w"), timeout=60) == 1
    out = capsys.readouterr().out
    assert "A exit -6" in out and "torch's gloo teardown" in out and "os._exit(0)" in out
    assert "after Checkpointer.close()" in out  # os._exit skips the exit-time wait for background saves
    plain = [sys.executable, "-c", "print('step 1 loss 0.5'); raise SystemExit(3)"]  # no abort: no such line
    assert run_drill(plain, work=str(tmp_path / "p"), timeout=60) == 1
    assert "torch's gloo teardown" not in capsys.readouterr().out
