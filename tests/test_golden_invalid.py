"""Every checkpoint under spec/golden/invalid/ is refused as its expect.json says: the validator
reports the named problem, and opening (for defects in COMMITTED or the manifest) or a verifying
load (for defects in the data files, the tiling, a stored value) raises the named error class of
``shardfmt.errors``, never a bare exception. The cases cover every item of the reject list
(FORMAT-v1.md section 11) and are what ``tests/golden_invalid_make.py`` writes.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from golden_invalid_make import CASES, INVALID, write_all
from test_spec_text import headings, read, reject_items

import shardfmt
from shardfmt import errors
from shardfmt.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(d for d in os.listdir(INVALID) if os.path.isdir(os.path.join(INVALID, d)))


def expect(name: str) -> dict:
    with open(os.path.join(INVALID, name, "expect.json"), encoding="utf-8") as f:
        return json.load(f)


def golden_targets() -> dict:
    """The state dict spec/golden/v1 was saved from, empty."""
    return {"model": {"w": torch.empty(6, 4), "head": torch.empty(6, 4), "norm": torch.empty(5, dtype=torch.bfloat16)},
            "optim": {"step": torch.empty((), dtype=torch.int64), "param_groups": None}, "rng": None}


@pytest.mark.parametrize("name", NAMES)
def test_invalid_checkpoint_is_refused_as_expected(name, capsys):
    path = os.path.join(INVALID, name)
    want = expect(name)
    error = getattr(errors, want["error"])
    assert issubclass(error, errors.ShardfmtError)
    report = shardfmt.validate(path, deep=True)
    assert want["problem"] in [p.code for p in report.problems], report.problems
    # `shardfmt validate --deep`: 1 for an invalid checkpoint, 2 for a format version it cannot judge
    assert cli_main(["validate", "--deep", path]) == (2 if want["problem"] == "format_version" else 1)
    assert "INVALID" in capsys.readouterr().out or want["problem"] == "format_version"
    if want["fails_at"] == "open":
        with pytest.raises(error):
            shardfmt.read_manifest(path)
    else:
        assert want["fails_at"] == "load"
        shardfmt.read_manifest(path)  # the defect is past what opening checks
    with pytest.raises(error):
        shardfmt.load(golden_targets(), path, rank=1)


def test_every_case_names_a_rule_of_the_spec_and_every_reject_item_has_a_case():
    items = reject_items("FORMAT-v1.md")  # these are version-1 checkpoints, judged by version 1's rules
    sections = headings(read("FORMAT-v1.md"))
    named = set()
    for name in NAMES:
        want = expect(name)
        assert want["section"] in sections, name
        assert (want["item"] is None) == (want["section"] != "11"), name
        assert want["item"] is None or want["item"] in items, name
        named.add(want["item"])
    assert set(items) <= named


def _tree(root: str) -> dict:
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        for n in dirnames + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


def test_the_committed_cases_are_what_the_generator_writes(tmp_path):
    write_all(str(tmp_path))
    assert sorted(c.name for c in CASES) == NAMES
    assert _tree(str(tmp_path)) == _tree(INVALID)


@pytest.mark.slow
def test_the_validate_command_exits_1_on_an_invalid_case():
    """The process's exit status, once (the other cases call the CLI's ``main`` in process)."""
    p = subprocess.run([sys.executable, "-m", "shardfmt.cli", "validate", os.path.join(INVALID, "item14-truncated-file")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1 and "file_size" in p.stdout, p.stdout + p.stderr
