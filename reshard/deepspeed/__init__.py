"""Import a DeepSpeed ZeRO checkpoint (stages 1, 2, 3) as a shardfmt checkpoint.

Modules: ``ptfile`` (a ``torch.save`` zip read through the shared restricted unpickler,
tensors as checked references read by element range), ``records`` (the pickled dicts checked
into frozen records), ``layout`` (pure: where each parameter lies in the flat partitions,
zero_to_fp32's arithmetic), ``importer`` (``import_deepspeed``), ``partitions`` (pure: a dp
rank's DeepSpeed flat partitions as ``FlatShard`` load targets, ``flat_targets``, the way back).

A DeepSpeed save directory holds ``latest`` (the tag) and ``<tag>/``: per data-parallel rank
an ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (that rank's fp32 partition and Adam
state of every flat group), and ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (ZeRO-3) with the parameter shapes,
buffers, frozen parameters and ties. Protocol of ``import_deepspeed``:

1) refuse unless the caller states ``trust_pickle=True``, and a DST that is SRC, holds it or
   lies inside it; read the tag from ``latest`` unless given;
2) list the tag directory (MoE, pipeline and model-parallel files are refused); open rank 0's
   optim file: its ``zero_stage`` and ``partition_count`` say which files must exist; open and
   check every one (a missing rank, another stage or world size is refused, naming the file);
3) plan (pure, ``layout``): each trainable parameter as pieces of the ranks' flats, checked
   against the lengths the files were checked to hold;
4) check every storage's zip CRC-32 (``verify``);
5) open a ``CheckpointWriter`` on DST; write, as rank 0, buffers (floating ones as fp32), frozen
   parameters (fp32), trainable fp32 masters and their ``exp_avg``/``exp_avg_sq``/``step``, in
   parts of at most ``memory_budget`` bytes; add ``step`` values that are numbers, the
   ``optim.param_groups`` hyperparameters and ties as aliases; commit. Any failure aborts the
   staging directory.

Names: ``model.<name>`` (``model_prefix``) for parameters and buffers, as zero_to_fp32 names
them; ``optim.state.<name>.<key>`` and ``optim.param_groups`` (``params`` listing names), so
``shardfmt.load(shardfmt.get_state_dict(model, adamw), dst)`` fills a plain torch model and
optimizer. A tied parameter (``shared_params``) is an alias of its owner; its state is the owner's.

What is not imported: ZeRO-1 frozen parameters (saved only in the model dtype; zero_to_fp32
leaves them out too: they are listed in the report), BF16_Optimizer and ZeRO-0 checkpoints,
MoE, pipeline and tensor parallelism, DeepSpeed's universal checkpoints, the loss scaler, the
LR scheduler and ``client_state``. Padding in the partitions is never read.

Trade-offs: a parameter is gathered whole (peak memory about ``max(memory_budget, largest
parameter)`` plus one part); the output is one rank's files (``reshard convert`` lays it out
for a mesh).
"""

from reshard.deepspeed.importer import TRUST_PICKLE_HELP, DeepSpeedImportReport, import_deepspeed

__all__ = ["TRUST_PICKLE_HELP", "DeepSpeedImportReport", "import_deepspeed"]
