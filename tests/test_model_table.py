"""The README's and docs/models.md's model tables name parity tests that exist: every
`tests/...py` path is a file, and every `::test_name` in it is a test defined there."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)?)(?:\[[\w-]+\])?`")


def _table_references(document: str) -> list[tuple[str, str]]:
    rows = [line for line in (ROOT / document).read_text().splitlines() if line.startswith("|")]
    return [(path, name.removeprefix("::")) for row in rows for path, name in TEST_REFERENCE.findall(row)]


@pytest.mark.parametrize("document", ["README.md", "docs/models.md"])
def test_named_parity_tests_exist(document):
    references = _table_references(document)
    assert len(references) >= 7, references
    for path, name in references:
        source = ROOT / path
        assert source.is_file(), f"{document} names {path}, which does not exist"
        if name:
            assert re.search(rf"^(async )?def {name}\(", source.read_text(), re.M), f"{document}: no {name} in {path}"
