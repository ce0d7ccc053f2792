"""reshard: offline tools on top of shardfmt.

``reshard.convert.convert`` (a checkpoint for a new mesh), ``reshard.hf.export_hf`` /
``import_hf`` (the Hugging Face layout), ``reshard.dcp_import.import_dcp`` (a DCP checkpoint,
without running its pickles), and the ``reshard`` command line. The planner, geometry and
topology they use live in ``shardfmt.load`` and ``shardfmt.layout``.
"""
