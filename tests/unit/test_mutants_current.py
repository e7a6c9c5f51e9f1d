"""scripts/mutants.py stays in step with the code: every mutant's code, as it is, occurs exactly once in its file
(a refactor that rewrites the line leaves a mutant that can no longer be applied, found only at the next
mutation run otherwise)."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutants", REPO / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_each_mutant_still_applies(name):
    path, code, mutant, tests = mutants.MUTANTS[name]
    assert (REPO / path).read_text().count(code) == 1, f"{name}: update scripts/mutants.py for {path}"
    assert mutant != code and all((REPO / t).exists() for t in tests if t.startswith("tests/"))
