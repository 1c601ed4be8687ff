"""scripts/mutation_check.py's mutations still apply: each old string occurs exactly once in its file.

A mutation whose code moved would make the script fail (it never skips one); this catches that in CI,
where the mutations themselves (each a full pytest run) are not run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import mutation_check  # noqa: E402


@pytest.mark.parametrize("m", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_once(m, tmp_path):
    (tmp_path / m.file).parent.mkdir(parents=True)
    shutil.copy(REPO / m.file, tmp_path / m.file)
    assert mutation_check.apply(m, tmp_path) is None
    assert (tmp_path / m.file).read_text() != (REPO / m.file).read_text()
