"""Drill a, end to end: the demo's torchrun job is SIGKILLed, restarted and resumes bit for bit."""

import argparse
import json
import os

import pytest

from shardfmt.demo.run import run_demo

pytestmark = pytest.mark.slow


def test_killed_job_resumes_bit_for_bit(tmp_path, capsys):
    assert run_demo(argparse.Namespace(dir=str(tmp_path), plot=None)) == 0
    out = capsys.readouterr().out
    assert "bit for bit: YES" in out and "resumed from step 20" in out
    # the restarted job really lost work: rank 1 logged step 25 before dying, then redid 21..25
    with open(os.path.join(tmp_path, "B.rank1.jsonl")) as f:
        steps = [json.loads(line).get("step") for line in f]
    assert steps.count(25) == 2 and steps.count(21) == 2 and steps.count(20) == 1
