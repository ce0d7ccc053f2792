"""Every checkpoint under spec/golden/invalid-v2/ is refused as its expect.json says: the validator
reports the named problem, and opening the root (for defects in COMMITTED or the root manifest)
or a load (for defects in the rank table, the rank indexes, the data files, the tiling, a stored
value) raises exactly the named error class of ``shardfmt.errors``, never a bare exception. The
cases cover every item of the reject list (FORMAT.md section 11) and are what
``tests/golden_invalid_v2_make.py`` writes.

A case whose defect git cannot hold (a FIFO) is copied and completed here before use
(``expect.json``'s ``special``).
"""

import json
import os
import shutil

import pytest
import torch
from deadline import deadline
from golden_invalid_v2_make import CASES, INVALID, make_special, write_all
from test_golden_invalid import _tree
from test_golden_v2 import GOLDEN, whole_targets
from test_spec_text import headings, read, reject_items

import shardfmt
from shardfmt import errors
from shardfmt.cli import main as cli_main
from shardfmt.loading.reader import open_checkpoint

NAMES = sorted(d for d in os.listdir(INVALID) if os.path.isdir(os.path.join(INVALID, d)))


def expect(name: str) -> dict:
    with open(os.path.join(INVALID, name, "expect.json"), encoding="utf-8") as f:
        return json.load(f)


def case_path(name: str, tmp_path) -> str:
    """The case's checkpoint: the committed one, or a copy completed with what git cannot hold."""
    special = expect(name).get("special")
    if special is None:
        return os.path.join(INVALID, name)
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(INVALID, name), path, symlinks=True)
    make_special(path, special)
    return path


@pytest.mark.parametrize("name", NAMES)
def test_invalid_v2_checkpoint_is_refused_as_expected(name, capsys, tmp_path):
    path = case_path(name, tmp_path)
    want = expect(name)
    error = getattr(errors, want["error"])
    assert issubclass(error, errors.ShardfmtError)
    with deadline(60, f"{name}: validate and load"):  # a FIFO must never be waited on
        report = shardfmt.validate(path, deep=True)
        if want["problem"] is None:  # a valid checkpoint that one load cannot use (a rank without its value)
            assert report.ok, report.problems
        else:
            assert want["problem"] in [p.code for p in report.problems], report.problems
            # `shardfmt validate --deep`: 1 for an invalid checkpoint, 2 for a format version it cannot judge
            assert cli_main(["validate", "--deep", path]) == (2 if want["problem"] == "format_version" else 1)
            assert "INVALID" in capsys.readouterr().out or want["problem"] == "format_version"
        if want["fails_at"] == "open":
            with pytest.raises(error) as opened:
                open_checkpoint(path, whole=False)
            assert type(opened.value) is error, opened.value
        else:
            assert want["fails_at"] == "load"
            open_checkpoint(path, whole=False)  # the defect is past the root: a load meets it finding its part
        with pytest.raises(error) as loaded:
            shardfmt.load(whole_targets(), path, rank=1)  # every tensor whole: every rank's data
        assert type(loaded.value) is error, loaded.value


def test_every_case_names_a_rule_of_the_spec_and_every_reject_item_has_a_case():
    items = reject_items("FORMAT.md")
    sections = headings(read("FORMAT.md"))
    named = set()
    for name in NAMES:
        want = expect(name)
        assert set(want) <= {"section", "item", "defect", "fails_at", "error", "problem", "special"}, name
        assert want["section"] in sections, name
        assert (want["item"] is None) == (want["section"] != "11"), name
        assert want["item"] is None or want["item"] in items, name
        named.add(want["item"])
    assert set(items) <= named
    assert {"8", "10"} <= {expect(n)["section"] for n in NAMES}


def test_the_committed_cases_are_what_the_generator_writes(tmp_path):
    write_all(str(tmp_path))
    assert sorted(c.name for c in CASES) == NAMES
    assert _tree(str(tmp_path)) == _tree(INVALID)


def test_a_load_that_does_not_need_a_damaged_rank_index_still_reads_its_part():
    """Rank 2's index is missing: what rank 1 wrote (model.norm, model.emb's rows [18, 24)) still
    loads, since a load reads only the indexes of the ranks whose boxes it reads."""
    path = os.path.join(INVALID, "item03-index-missing")
    norm = torch.empty(5, dtype=torch.bfloat16)
    rows = torch.empty(6, 64)
    shardfmt.load({"model": {"norm": norm, "emb": shardfmt.ShardedTensor(rows, (24, 64), (18, 0))}}, path,
                  strict=False)
    want = {"model": {"norm": torch.empty(5, dtype=torch.bfloat16), "emb": torch.empty(24, 64)}}
    shardfmt.load(want, GOLDEN, strict=False)
    assert torch.equal(norm, want["model"]["norm"]) and torch.equal(rows, want["model"]["emb"][18:])
