"""Shared settings for the formal checks.

CI=true selects Hypothesis's derandomised "ci" profile. CADENCE_EXPLORE=1
selects a long randomised profile; CADENCE_SPEC_SCOPE=medium|large widens the
exhaustive exploration (see spec/README.md).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "cadence-explore", max_examples=2000, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CADENCE_EXPLORE") == "1":
    settings.load_profile("cadence-explore")


@pytest.fixture(scope="session")
def spec_scope() -> str:
    """The exploration scope the suite runs at."""
    return os.environ.get("CADENCE_SPEC_SCOPE", "small")
