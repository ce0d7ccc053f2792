"""shardfmt's benchmarks: one harness (``benchmarks/harness``), the state builders
(``states``), the raw I/O floors (``floors``), every timed method (``candidates``), and
scenario files (``scenarios/``) that only declare what they time. Run
``python benchmarks/run.py --list``; figures and method: benchmarks/README.md."""
