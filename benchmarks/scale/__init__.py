"""Metadata at scale: format v1 and DCP, their own functions fed N ranks' synthetic inputs.

``python -m benchmarks.scale [--layouts 8b,70b] [--ranks 64,1024,4096] [--repeat 3] [--budget-s S]``
simulates what one rank pays for a checkpoint's metadata at N ranks without N processes:
``layouts`` (the states and meshes), ``adapter`` (the interface a format implements),
``v1`` / ``sim_v1`` (shardfmt format v1), ``dcp`` (torch.distributed.checkpoint), ``measure``
(one measurement per fresh process: CPU seconds, peak RSS above the import baseline),
``cli`` (the driver: budget, projections, the table and the JSON). Figures and method:
benchmarks/README.md, "Metadata at scale (v1 vs DCP)".
"""
