"""The ``reshard`` command: ``plan`` shows which saved bytes feed a rank of a new topology;
``convert`` rewrites a checkpoint for a new mesh; ``export-hf`` / ``import-hf`` move between
shardfmt and the Hugging Face safetensors layout; ``import-dcp`` reads a DCP checkpoint,
``import-deepspeed`` a DeepSpeed ZeRO checkpoint.

Exit codes: 0 success, 1 the checkpoint or plan is unusable, 2 bad arguments (a destination
that is, holds or lies inside the source included), an unreachable path, a path that names no
checkpoint (a Checkpointer root, a Hugging Face folder) or a checkpoint of a format version this
release cannot read, 130 interrupted (Ctrl-C), 141 stdout closed early (``| head``). Errors print
one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from reshard.options import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_MODEL_PREFIX,
)
from reshard.sizes import parse_size
from shardfmt._version import __version__
from shardfmt.cli.output import deferred, run
from shardfmt.cli.parser import Parser
from shardfmt.loading.options import (  # torch-free, unlike reshard._shardfmt
    DEFAULT_MAX_GAP,
    DEFAULT_MAX_READ,
)

__all__ = ["build_parser", "main"]


def _command(name: str):
    """The command ``name`` of ``reshard.cli.commands`` (it needs torch: imported when it runs)."""
    return deferred("reshard.cli.commands", "run", name)


def _size(*, zero: bool = False):
    """An argparse type: a size in bytes (``16MiB``, ``1048576``; ``0`` where ``zero``)."""
    def parse(text: str) -> int:
        if zero and text.strip() == "0":
            return 0
        try:
            return parse_size(text, what="size")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None

    return parse


def _int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (argparse reports anything else, exit 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            upto = f" and <= {hi}" if hi is not None else ""
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}{upto}, got {text!r}")
        return v

    return parse


_BUDGET_HELP = "tensor bytes held at once (e.g. 1GiB, 256MiB; GB = 10^9); default 1GiB"


def _stream_args(p: argparse.ArgumentParser, *, budget_help: str, overwrite_help: str, verify: bool) -> None:
    """The flags convert, export-hf and import-hf share."""
    p.add_argument("--memory-budget", default=DEFAULT_BUDGET, metavar="SIZE", help=budget_help)
    if verify:
        p.add_argument("--no-verify", action="store_true", help="do not check source chunk hashes while reading")
    p.add_argument("--overwrite", action="store_true", help=overwrite_help)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for SRC and DST")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="reshard", description="Move shardfmt checkpoints between topologies.")
    p.add_argument("--version", action="version", version=f"reshard (shardfmt) {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_plan, _add_import_dcp, _add_import_deepspeed, _add_convert, _add_export_hf, _add_import_hf):
        add(sub)
    return p


def _source(p: argparse.ArgumentParser, verb: str) -> None:
    """SRC, a shardfmt checkpoint or (with --step) a Checkpointer root."""
    p.add_argument("src", help=f"the checkpoint to {verb} (directory or URL; a Checkpointer root with --step)")
    p.add_argument("--step", type=int, dest="src_step", help="SRC is a Checkpointer root: use its checkpoint of this step")


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="print which saved bytes feed one rank of a new mesh (reads no data)")
    _source(pl, "read")
    pl.add_argument("--mesh", required=True, help="new mesh, outermost first, e.g. pp=2,dp=2,tp=4")
    pl.add_argument("--rank", type=int, required=True, help="the rank of the new mesh to plan the reads of")
    pl.add_argument("--no-verify", action="store_true", help="plan without rounding reads to hash chunks")
    pl.add_argument("--max-gap", type=_size(zero=True), default=DEFAULT_MAX_GAP, metavar="SIZE",
                    help="coalesce reads across gaps up to this (e.g. 1MiB; 0: never)")
    pl.add_argument("--max-read", type=_size(), default=DEFAULT_MAX_READ, metavar="SIZE",
                    help="largest single read (e.g. 16MiB)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--storage-options", metavar="JSON", help="fsspec options for SRC as a JSON object")
    pl.set_defaults(func=_command("plan"))


def _import_args(p: argparse.ArgumentParser, *, src: str, pickles: str, step: str, budget: str) -> None:
    """The arguments import-dcp and import-deepspeed share."""
    p.add_argument("src", help=src)
    p.add_argument("dst", help="shardfmt checkpoint to create")
    p.add_argument("--trust-pickle", action="store_true",
                   help=f"required: confirm you trust SRC, whose {pickles} (read with an allowlist)")
    p.add_argument("--step", type=_int_at_least(0, 1 << 62), help=step)  # the manifest's range (spec section 4)
    p.add_argument("--memory-budget", default=DEFAULT_MEMORY_BUDGET, metavar="SIZE",
                   help=f"tensor bytes held at once (e.g. 1GiB, 256MiB; GB = 10^9; default 1GiB); {budget}")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for SRC and DST")


def _add_import_dcp(sub) -> None:
    di = sub.add_parser(
        "import-dcp", help="import a torch.distributed.checkpoint directory (.metadata + .distcp) keeping its shards",
        description="Import a torch.distributed.checkpoint directory as a shardfmt checkpoint: every saved "
                    "chunk becomes a shard with the same box, non-tensor values become typed JSON. "
                    "DCP's .metadata is a Python pickle, which can run code when loaded: it is read only with "
                    "--trust-pickle, through a restricted unpickler that refuses every global except DCP's "
                    "metadata classes, torch.Size and torch dtypes; tensor data is read with "
                    "torch.load(weights_only=True).")
    _import_args(di, src="DCP checkpoint directory (holding .metadata)", pickles=".metadata is a pickle",
                 step="training step to record in the manifest",
                 budget="each rank's file is split into parts of at most this (a larger single chunk is a part "
                        "of its own)")
    di.add_argument("--skip-unsupported-values", action="store_true",
                    help="skip (with a warning) non-tensor values that are not typed-JSON representable "
                         "instead of refusing the import")
    di.add_argument("--no-progress", action="store_true", help="no progress bar")
    di.add_argument("--json", action="store_true", help="print the report as JSON")
    di.set_defaults(func=_command("import_dcp"))


def _add_import_deepspeed(sub) -> None:
    ds = sub.add_parser(
        "import-deepspeed", help="import a DeepSpeed ZeRO-1/2/3 checkpoint (full fp32 params + Adam state)",
        description="Import a DeepSpeed ZeRO checkpoint (the save directory holding 'latest') as a shardfmt "
                    "checkpoint: every parameter as the full fp32 tensor zero_to_fp32 rebuilds (under "
                    "--model-prefix), its Adam state as optim.state.<name>.{exp_avg,exp_avg_sq,step}, the "
                    "hyperparameters as optim.param_groups. DeepSpeed's .pt files are Python pickles, which can run "
                    "code when loaded: they are read only with --trust-pickle, through a restricted unpickler that "
                    "refuses every global except torch's tensor rebuilders, storages and dtypes and DeepSpeed's "
                    "ZeroStageEnum, LossScaler and fragment_address (as inert stand-ins).")
    _import_args(ds, src="DeepSpeed save directory (holding 'latest' and the tag directory)",
                 pickles=".pt files are pickles",
                 step="training step to record in the manifest (default: DeepSpeed's global_steps)",
                 budget="a larger tensor is held alone")
    ds.add_argument("--tag", help="the tag directory to import (default: the content of SRC/latest)")
    ds.add_argument("--model-prefix", default=DEFAULT_MODEL_PREFIX, metavar="P",
                    help=f"prefix of parameter and buffer names (default {DEFAULT_MODEL_PREFIX!r}, as "
                         "shardfmt.get_state_dict names a model; '' for zero_to_fp32's bare names)")
    ds.add_argument("--format-version", type=int, choices=(1, 2), help="shardfmt format version to write "
                                                                      "(default: the writer's)")
    ds.add_argument("--no-verify", action="store_true", help="skip checking the zip CRC-32 of every storage")
    ds.add_argument("--no-progress", action="store_true", help="no progress bar")
    ds.set_defaults(func=_command("import_deepspeed"))


def _add_convert(sub) -> None:
    cv = sub.add_parser("convert", help="rewrite a checkpoint for a new mesh: each new rank's slices in its own file",
                        description="Rewrite SRC for a new topology as DST: every rank of MESH gets a data file with "
                                    "the slices it holds (replicated slices written once, balanced across ranks), "
                                    "streaming in bounded memory; the result is validated before it is committed.")
    _source(cv, "convert")
    cv.add_argument("dst", help="the checkpoint to write (refused if it is, holds or lies inside SRC)")
    cv.add_argument("--mesh", required=True, help="new mesh, outermost first, e.g. pp=1,dp=2,tp=4")
    cv.add_argument("--rules", metavar="FILE", help="JSON placement rules (regex on FQN -> placement); see README")
    cv.add_argument("--dtype", help="cast floating tensors, e.g. bf16, fp16, fp32")
    cv.add_argument("--per-rank", choices=("drop", "error"), default="drop",
                    help="per-rank values (RNG states) when the world size changes: leave out (default) or refuse")
    cv.add_argument("--deep-validate", action="store_true", help="re-hash every written chunk before committing")
    _stream_args(cv, budget_help=_BUDGET_HELP, overwrite_help="replace a committed checkpoint at DST", verify=True)
    cv.set_defaults(func=_command("convert"))


def _add_export_hf(sub) -> None:
    ex = sub.add_parser("export-hf", help="write the Hugging Face layout (model*.safetensors, index, config.json)",
                        description="Export SRC as a directory transformers' from_pretrained loads: safetensors "
                                    "shards, model.safetensors.index.json when there are several, config.json from "
                                    "the checkpoint's metadata['hf_config'] or --config.")
    _source(ex, "export")
    ex.add_argument("dst", help="the Hugging Face directory to write")
    ex.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                    help="largest file (default 5GB = 5*10^9)")
    ex.add_argument("--dtype", help="cast floating tensors, e.g. bf16")
    ex.add_argument("--only", metavar="PREFIX", help="export only the subtree PREFIX, with PREFIX. stripped "
                                                     "(e.g. --only model for a Checkpointer's {'model': ...})")
    ex.add_argument("--strip-prefix", metavar="P", help="remove P from the start of every name that has it")
    ex.add_argument("--add-prefix", metavar="P", help="prepend P to every name")
    ex.add_argument("--config", metavar="FILE", help="config.json to write (overrides the checkpoint's)")
    _stream_args(ex, budget_help=_BUDGET_HELP, overwrite_help="replace DST if it exists", verify=True)
    ex.set_defaults(func=_command("export_hf"))


def _add_import_hf(sub) -> None:
    im = sub.add_parser("import-hf", help="import a Hugging Face safetensors directory as a shardfmt checkpoint",
                        description="Import an HF safetensors model (one file or indexed) as DST: one rank, or "
                                    "each rank of --mesh with its own file (placements from --rules).")
    im.add_argument("src", help="directory with model.safetensors or model.safetensors.index.json")
    im.add_argument("dst", help="the shardfmt checkpoint to create")
    im.add_argument("--mesh", help="lay the tensors out on this mesh, e.g. tp=4 (default: one rank)")
    im.add_argument("--rules", metavar="FILE", help="JSON placement rules for --mesh; see README")
    im.add_argument("--dtype", help="cast floating tensors, e.g. bf16")
    _stream_args(im, budget_help=_BUDGET_HELP, overwrite_help="replace a committed checkpoint at DST", verify=False)
    im.set_defaults(func=_command("import_hf"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dst = getattr(args, "dst", None)  # the tools stage their output and commit it last: nothing half-written
    return run("reshard", args.func, args, interrupted="" if dst is None else f"; {dst} left as it was")


if __name__ == "__main__":
    sys.exit(main())
