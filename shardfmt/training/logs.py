"""Logs and metrics that continue without a duplicated segment (issue 20, item 4).

A job killed after step 25 and resumed from the checkpoint of step 20 logs steps 21-25 twice:
once in the lost run, once again after the resume. ``Checkpointer.restore`` returns the step
it resumed from (and keeps it in ``restored_step``); a logger rewinds to it:

- TensorBoard: ``SummaryWriter(log_dir, purge_step=step + 1)`` drops the events of later steps;
- Weights & Biases: ``wandb.init(id=run_id, resume="allow")`` and ``wandb.log(..., step=s)``
  with the training step (W&B refuses steps below its last one: log the rewound ones under a
  new run or accept the gap);
- a JSON-lines log of your own: ``rewind_jsonl(path, step)`` (the demo's).
"""

from __future__ import annotations

import json
import os


def rewind_jsonl(path: str, step: int, *, key: str = "step") -> list[int]:
    """Drop the records of ``path`` (one JSON object a line) whose ``key`` is above ``step``;
    return the steps dropped, in order. The file is replaced atomically (written aside, fsynced,
    renamed); records without ``key`` are kept; a missing file is no log to rewind. A last line
    cut off mid-record (the job was killed while writing it) is dropped; a line that is not JSON
    anywhere else is an error naming it."""
    if not os.path.exists(path):
        return []
    kept, dropped, torn = [], [], False
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                torn = True  # cut off by the crash
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
        if isinstance(rec, dict) and isinstance(rec.get(key), int) and rec[key] > step:
            dropped.append(rec[key])
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped or torn:
        tmp = f"{path}.rewind-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


__all__ = ["rewind_jsonl"]
