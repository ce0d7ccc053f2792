"""Usage errors in the command lines' own words (issue 21): a mistyped command or flag gets the
usage of the command it was given to, the nearest valid spelling, and exit status 2."""

from __future__ import annotations

import json
import os
import re

import pytest

import shardfmt
from reshard.cli import main as reshard_main
from shardfmt.cli import main as shardfmt_main


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("main, argv, usage, hint", [
    (shardfmt_main, ["validate", "x", "--depp"], "usage: shardfmt validate", "(did you mean --deep?)"),
    (shardfmt_main, ["gc", "r", "--dryrun"], "usage: shardfmt gc", "(did you mean --dry-run?)"),
    (reshard_main, ["convert", "a", "b", "--mesh", "tp=2", "--memmory-budget", "1GiB"], "usage: reshard convert",
     "(did you mean --memory-budget?)"),
    (reshard_main, ["export-hf", "a", "b", "--max-shard-sise", "1GB"], "usage: reshard export-hf",
     "(did you mean --max-shard-size?)"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_the_nearest_flag(capsys, main, argv, usage, hint):
    err = _usage_error(main, argv, capsys)
    assert err.startswith(usage) and err.rstrip().endswith(hint), err
    assert f"unrecognized arguments: {argv[-2] if argv[-1][0] != '-' else argv[-1]}" in err


@pytest.mark.parametrize("main, argv, hint", [
    (shardfmt_main, ["validat", "x"], "did you mean 'validate'?"),
    (shardfmt_main, ["inpsect", "x"], "did you mean 'inspect'?"),
    (reshard_main, ["export_hf", "a", "b"], "did you mean 'export-hf'?"),
])
def test_a_mistyped_command_gets_the_nearest_command(capsys, main, argv, hint):
    err = _usage_error(main, argv, capsys)
    assert "invalid choice" in err and err.rstrip().endswith(hint), err


def test_a_flag_nothing_resembles_gets_no_guess(capsys):
    err = _usage_error(shardfmt_main, ["ls", "r", "--zzzzzz"], capsys)
    assert err.startswith("usage: shardfmt ls") and "did you mean" not in err


GOLDEN_V2 = os.path.join(os.path.dirname(__file__), "..", "spec", "golden", "v2")


def test_inspect_tensors_lists_names_shapes_dtypes_placements_and_bytes(capsys):
    assert shardfmt_main(["inspect", GOLDEN_V2, "--tensors", "model.layers.*", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [
        {"name": "model.layers.0.w1", "shape": [8, 4], "dtype": "F16", "bytes": 64, "placement": "dp:StridedShard(0, 2)"},
        {"name": "model.layers.0.wo", "shape": [4, 6], "dtype": "F32", "bytes": 96, "placement": "dp:Replicate tp:Shard(1)"},
        {"name": "model.layers.0.wq", "shape": [8, 4], "dtype": "F32", "bytes": 128,
         "placement": "dp:StridedShard(0, 2) tp:Shard(0)"},
    ]
    assert shardfmt_main(["inspect", GOLDEN_V2, "--tensors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and lines[1].split()[:2] == ["model.head", "24x64"] and lines[1].endswith("alias of model.emb")
    assert shardfmt_main(["inspect", GOLDEN_V2, "--tensors", "nothing.*"]) == 0
    assert capsys.readouterr().out == "no tensor matches\n"


def test_gc_names_the_saves_whose_lease_holds_and_when_it_expires(tmp_path, capsys):
    import torch

    import shardfmt.saving.writer as writer

    root = tmp_path / "root"
    shardfmt.save({"w": torch.ones(4)}, str(root / "step_000000001"), step=1)
    w = writer.CheckpointWriter(str(root / "step_000000002"))  # a save that is still writing
    w.write_rank(0, [writer.ShardData(fqn="w", data=torch.ones(4), global_shape=(4,), offsets=(0,))])
    assert shardfmt_main(["gc", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["removed"] == [] and len(got["leased"]) == 1
    assert 590 <= got["leased"][0]["expires_in_s"] <= 600  # the local lease: 600 s from its last renewal
    assert shardfmt_main(["gc", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"left {got['leased'][0]['path']}: its save holds a lease until ") and re.search(r"\(in (9|10) min", out)
    assert "nothing to collect" not in out
    assert shardfmt_main(["gc", str(root), "--lease-seconds", "0"]) == 0  # now dead: removed, nothing left
    out = capsys.readouterr().out
    assert out.startswith("removed ") and "left " not in out
    assert sorted(os.listdir(root)) == ["step_000000001"]


@pytest.mark.parametrize("build", ["shardfmt.cli", "reshard.cli"])
def test_every_argument_of_every_command_has_help(build):
    import argparse
    import importlib

    parser = importlib.import_module(build).build_parser()
    missing = [(name, x.dest) for a in parser._actions if isinstance(a, argparse._SubParsersAction)
               for name, sub in a.choices.items() for x in sub._actions
               if not x.help and not isinstance(x, argparse._HelpAction)]
    assert missing == []


def test_plan_takes_sizes_like_the_other_commands(tmp_path, capsys):
    import torch

    path = str(tmp_path / "c")
    shardfmt.save({"w": torch.ones(1024, 1024)}, path)
    plans = []
    for read, gap in (("1MiB", "0"), ("1048576", "0"), ("1MB", "4KiB")):
        assert reshard_main(["plan", path, "--mesh", "tp=2", "--rank", "0", "--json", "--max-read", read,
                             "--max-gap", gap]) == 0
        plans.append(json.loads(capsys.readouterr().out)["reads"])
    assert plans[0] == plans[1] and len(plans[0]) == 4 and plans[2] != plans[0]  # 4 MiB in reads of 1 MiB, or 1 MB
