"""The command-line tools refuse what would destroy a user's data or run away, and fail the way
their exit-code convention says (0 ok, 1 unusable checkpoint, 2 bad argument or unreachable
path, 130 Ctrl-C, 141 stdout closed): one line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from deadline import deadline

import shardfmt
from reshard.cli import main as reshard_main
from reshard.topology import Mesh, TopologyError
from shardfmt.cli import main as shardfmt_main
from shardfmt.validation import validate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def tiny(tmp_path) -> str:
    """A committed checkpoint, step 1 of a checkpoint root: <tmp>/root/step_000000001."""
    path = str(tmp_path / "root" / "step_000000001")
    shardfmt.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, path, step=1)
    return path


def _rc(main, argv: list[str]):
    """Exit status of ``main(argv)``, argparse's refusals included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _tree(path: str) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(path) for f in files)


# ----------------------------------------------------------------------------- the source survives


@pytest.mark.parametrize("command", [["convert", "--mesh", "tp=2"], ["export-hf"]])
@pytest.mark.parametrize("where", ["the source", "its root", "inside it", "a symlink to its root"])
def test_overwrite_onto_the_source_its_root_or_inside_it_is_refused(tiny, tmp_path, capsys, command, where):
    root = os.path.dirname(tiny)
    os.symlink(root, tmp_path / "alias")
    dst = {"the source": tiny, "its root": root, "inside it": os.path.join(tiny, "out"),
           "a symlink to its root": str(tmp_path / "alias")}[where]
    before = _tree(root)
    rc = reshard_main([command[0], tiny, dst, *command[1:], "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "OverlapError" in err and "source" in err and err.count("\n") == 1
    assert _tree(root) == before and validate(tiny).ok
    assert sorted(os.listdir(tmp_path)) == ["alias", "root"]  # no staging dir left either


def test_import_hf_onto_the_directory_holding_its_source_is_refused(tiny, tmp_path, capsys):
    hf = tmp_path / "models" / "hf"
    assert reshard_main(["export-hf", tiny, str(hf), "--no-progress"]) == 0
    before = _tree(str(hf))
    for dst in (hf.parent, hf, hf / "ck"):
        capsys.readouterr()
        assert reshard_main(["import-hf", str(hf), str(dst), "--overwrite", "--no-progress"]) == 2
        assert "OverlapError" in capsys.readouterr().err
    assert _tree(str(hf)) == before


# ----------------------------------------------------------------------------- meshes and rules


def test_a_mesh_beyond_the_formats_world_size_is_refused_at_once(tiny, tmp_path, capsys):
    dst = str(tmp_path / "dst")
    with deadline(20, "convert --mesh tp=99999999"):
        rc = reshard_main(["convert", tiny, dst, "--mesh", "tp=99999999", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "16777216" in err and err.count("\n") == 1
    assert not os.path.exists(dst)
    for bad, why in [("tp=4096,dp=4097", "world size 16781312"), ({"tp": True}, "bool"), ({"tp": 2.5}, "2.5"),
                     ("tp=0", ">= 1"), ("tp=" + "9" * 5000, "exceeds")]:
        with pytest.raises(TopologyError, match=why):
            Mesh.parse(bad)
    assert Mesh.parse("tp=4096,dp=4096").world_size == 1 << 24


@pytest.mark.parametrize("args", [["--mesh", "tp"], ["--mesh", "tp=2", "--max-read", "0"],
                                  ["--mesh", "tp=2", "--max-read", "-1"], ["--mesh", "tp=2", "--max-gap", "-5"]])
def test_plan_refuses_bad_arguments_with_exit_2(tiny, capsys, args):
    assert _rc(reshard_main, ["plan", tiny, "--rank", "0", *args]) == 2
    err = capsys.readouterr().err
    assert ("mesh" in err or "--max-" in err) and "Traceback" not in err and "TopologyError" not in err


def test_a_loose_mesh_is_echoed_normalised(tiny, tmp_path, capsys):
    assert reshard_main(["plan", tiny, "--mesh", " tp= 2, ", "--rank", "1"]) == 0
    assert capsys.readouterr().out.startswith("rank 1 of mesh tp=2 ")
    assert reshard_main(["convert", tiny, str(tmp_path / "c"), "--mesh", "tp= 2,", "--no-progress"]) == 0
    assert "ranks (tp=2)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad arguments: exit 2


def test_export_hf_with_a_missing_config_is_a_bad_argument(tiny, tmp_path, capsys):
    dst = str(tmp_path / "hf")
    assert reshard_main(["export-hf", tiny, dst, "--config", str(tmp_path / "missing.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "ConfigError" in err and err.count("\n") == 1
    assert not os.path.exists(dst)


def test_gc_on_a_missing_root_fails_like_ls(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert shardfmt_main(["ls", missing]) == 2
    ls_err = capsys.readouterr().err
    assert shardfmt_main(["gc", missing]) == 2
    out, err = capsys.readouterr()
    assert err == ls_err and "not a directory" in err and "nothing to collect" not in out


def test_demo_refuses_a_used_or_non_directory_dir(tmp_path, capsys, monkeypatch):
    import shardfmt.demo

    def launch(*a, **k):
        raise AssertionError("the demo started training")

    monkeypatch.setattr(shardfmt.demo, "_launch", launch)
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "A.rank0.jsonl").write_text("{}\n")
    for name, why in [("file", "not a directory"), ("used", "not empty")]:
        assert shardfmt_main(["demo", "--dir", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "x" and os.listdir(tmp_path / "used") == ["A.rank0.jsonl"]


# ----------------------------------------------------------------------------- validate, ls


@pytest.mark.parametrize("name", ["COMMITTED", "manifest.json"])
def test_validate_a_checkpoint_whose_file_is_a_directory_is_invalid_not_unreachable(tiny, capsys, name):
    os.remove(os.path.join(tiny, name))
    os.mkdir(os.path.join(tiny, name))
    assert shardfmt_main(["validate", tiny, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and any(p["file"] == name and "directory" in p["message"] for p in report["problems"])


def test_ls_and_validate_json_hold_names_that_are_not_utf8(tiny, capsys):
    root = os.path.dirname(tiny)
    odd = os.path.join(os.fsencode(root), b"step_\xff")
    os.rename(tiny, odd)
    assert shardfmt_main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"]) for r in rows] == [("step_\\xff", "committed")]
    assert shardfmt_main(["validate", os.fsdecode(odd), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["path"].endswith("step_\\xff")


# ----------------------------------------------------------------------------- pipes and Ctrl-C


@pytest.mark.parametrize("argv", [["reshard.cli", "plan", "{ck}", "--mesh", "tp=2", "--rank", "0"],
                                  ["shardfmt.cli", "inspect", "{ck}"]])
def test_a_closed_stdout_ends_quietly(tiny, argv):
    """``reshard plan ... | head``: the reader goes away; no traceback, exit 141 (as SIGPIPE)."""
    cmd = [sys.executable, "-m", *(a.format(ck=tiny) for a in argv)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # nobody reads: every write to stdout fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == ""


def test_ctrl_c_in_reshard_exits_130_without_a_traceback(tiny, tmp_path, monkeypatch):
    import reshard.convert

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(reshard.convert, "convert", interrupted)
    try:
        rc = reshard_main(["convert", tiny, str(tmp_path / "c"), "--mesh", "tp=2", "--no-progress"])
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt escaped (a traceback)"
    assert rc == 130
