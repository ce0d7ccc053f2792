"""Scenario files: each declares ``SCENARIOS``, a tuple of ``harness.model.Scenario`` — its
state, phases (candidates timed together), worlds and targets, and nothing else."""
