"""docs/api.md is generated from the code (scripts/api_docs.py): a public name, signature or docstring
changed without regenerating it fails here, so the reference never drifts from the code."""
import importlib.util
from pathlib import Path

import tiered_ckpt

REPO = Path(__file__).resolve().parents[2]


def load_api_docs_script():
    spec = importlib.util.spec_from_file_location("api_docs", REPO / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_md_is_what_the_code_says():
    generated = load_api_docs_script().render()
    written = (REPO / "docs" / "api.md").read_text()
    assert written == generated, "docs/api.md is out of date: run python scripts/api_docs.py"


def test_api_md_has_a_section_for_every_public_name():
    written = (REPO / "docs" / "api.md").read_text()
    missing = [name for name in tiered_ckpt.__all__ if f"\n## `{name}`\n" not in written]
    assert not missing, f"docs/api.md lacks {missing}: run python scripts/api_docs.py"
