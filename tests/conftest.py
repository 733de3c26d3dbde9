"""Hypothesis profiles for the whole suite.

- ``ci``: derandomised, no deadline, no example database; chosen when ``CI`` is set,
  so CI replays the same examples every run.
- ``explore``: 2000 examples per property with fresh random seeds; chosen with
  ``CADENCE_EXPLORE=1`` (it wins over ``CI``), for hunting bugs locally.
- ``dev``: Hypothesis defaults without a deadline, for everyday local runs.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", max_examples=2000, deadline=None)
settings.register_profile("dev", deadline=None)


def hypothesis_profile(environ=os.environ) -> str:
    """The profile the environment asks for."""
    if environ.get("CADENCE_EXPLORE") == "1":
        return "explore"
    if environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return "ci"
    return "dev"


settings.load_profile(hypothesis_profile())
