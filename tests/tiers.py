"""The two test tiers: the whole suite and the fast tier.

- Whole suite (CI: ``python -m pytest -q``): every test, every property test at its full count.
- Fast tier (``python -m pytest -m "not slow" -q``, the development loop, under 60 s): tests
  marked ``slow`` are left out (real processes, big states, the moto S3 server, fuzzers,
  timing bounds at scale) and conftest loads the hypothesis profile ``fast``, under which a
  property test runs ``examples(n)``: a tenth of its examples, at least 10. The same properties,
  fewer draws; CI keeps the full count. ``--hypothesis-profile=fast`` gives the reduced count to
  any run, ``--hypothesis-profile=default`` the full count to a fast-tier run.
"""

from __future__ import annotations

from hypothesis import settings

FAST_PROFILE = "fast"

settings.register_profile(FAST_PROFILE, max_examples=10)


def examples(full: int) -> int:
    """Return ``max_examples`` for a property test written for ``full`` examples."""
    if settings.get_current_profile_name() == FAST_PROFILE:
        return min(full, max(10, full // 10))
    return full
