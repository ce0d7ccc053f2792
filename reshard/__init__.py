"""reshard: offline tools on top of shardfmt.

``reshard.convert.convert`` (a checkpoint for a new mesh), ``reshard.hf_export.export_hf`` /
``reshard.hf_import.import_hf`` (the Hugging Face layout), ``reshard.dcp.importer.import_dcp``
(a DCP checkpoint, without running its pickles), and the ``reshard`` command line
(``reshard.cli``). They share one streaming engine (``reshard.stream``: plan | run) and one
set of tool errors (``reshard.errors``). The planner, geometry and topology they use live in
``shardfmt.loading`` and ``shardfmt.layout``; every shardfmt internal is imported through
``reshard._shardfmt``. shardfmt never imports reshard.
"""
