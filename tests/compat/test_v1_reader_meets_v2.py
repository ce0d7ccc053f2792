"""A v2 checkpoint, met by the v1 reader as released: a version error, never "invalid" or
"interrupted" (FORMAT.md section 4.9). A v1 Checkpointer sharing a root with a v2 writer must
not quarantine, count or delete the v2 checkpoints (ROOTS.md section 1).

The released reader is the package as of ``RELEASED_V1`` (the last commit before format v2),
taken from this repository's history with ``git archive`` and run in a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

import shardfmt
from shardfmt.saving.options import SaveOptions

RELEASED_V1 = "2044844"  # main when format v2 began: the last release that reads version 1 only
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _released_package(dest: str) -> str:
    """Extract the released ``shardfmt`` package into ``dest``; return the PYTHONPATH entry."""
    try:
        tar = subprocess.run(["git", "-C", REPO, "archive", RELEASED_V1, "shardfmt"], check=True,
                             capture_output=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"cannot read the released v1 reader from git history ({e}); CI runs in a clone with history")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest


PROBE = r"""
import json, os, sys, torch, shardfmt
from shardfmt import errors
path, root = sys.argv[1], sys.argv[2]
assert shardfmt.__file__.startswith(sys.argv[3]), shardfmt.__file__
out = {}
try:
    shardfmt.load({"w": torch.zeros(4, 4)}, path)
    out["load"] = "loaded"
except errors.ShardfmtError as e:
    out["load"] = [type(e).__name__, str(e)]
rep = shardfmt.validate(path)
out["validate"] = {"unsupported": rep.unsupported, "codes": [p.code for p in rep.problems]}
ck = shardfmt.Checkpointer(root)
try:
    got = ck.restore({"w": torch.zeros(4, 4)})
    out["restore"] = repr(got)
except errors.ShardfmtError as e:
    out["restore"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


@pytest.mark.slow  # imports a second shardfmt and torch in a subprocess
def test_released_v1_reader_reports_a_newer_version(tmp_path):
    old = _released_package(str(tmp_path / "released"))
    state = {"w": torch.arange(16.0).reshape(4, 4)}
    path = str(tmp_path / "ck")
    shardfmt.save(state, path, options=SaveOptions(format_version=2))
    root = str(tmp_path / "root")
    os.makedirs(root)
    shardfmt.save(state, os.path.join(root, "step_000000010"), step=10, options=SaveOptions(format_version=1))
    shardfmt.save(state, os.path.join(root, "step_000000020"), step=20, options=SaveOptions(format_version=2))
    before = sorted(os.listdir(root))
    env = {**os.environ, "PYTHONPATH": old}
    proc = subprocess.run([sys.executable, "-c", PROBE, path, root, old], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["load"][0] == "FormatVersionError" and "version 2" in out["load"][1], out
    assert out["validate"] == {"unsupported": True, "codes": ["format_version"]}, out
    # the v1 Checkpointer refuses to resume an older step behind the newer v2 one, and touches nothing
    assert out["restore"][0] in ("FormatVersionError", "CompatibilityError"), out
    assert sorted(os.listdir(root)) == before
    assert not any("QUARANTINED" in f for _, _, fs in os.walk(root) for f in fs)
