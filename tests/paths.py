"""Where the repository, its test data and the shared references beside it are."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TESTDATA = REPO / "tests" / "testdata"
