"""What the manager's tests share: ``opened``, the ``LowerTiers`` a test starts, closed after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tiercache.manager.lower_tiers import LowerTiers


@pytest.fixture
def opened() -> Iterator[list[LowerTiers]]:
    """LowerTiers a test starts (append them); each is closed afterwards."""
    made: list[LowerTiers] = []
    yield made
    for tiers in made:
        tiers.close()
