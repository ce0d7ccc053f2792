"""The harness: declarations (``model``), plan (rounds, rotation, jobs), worker (one rank),
launch, statistics and verdicts (``verdict``), report, driver."""
