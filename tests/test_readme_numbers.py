"""README's measured tables are what `python -m benchmarks --headline` prints from the committed CSVs: every
table row of `report.readme_markdown` stands verbatim in README.md."""

from pathlib import Path

from benchmarks import report

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_tables_are_the_headline_tables():
    """Each row of the prefill and decode tables (values included) appears in README.md as printed."""
    rows = [line for line in report.readme_markdown().splitlines()
            if line.startswith("| ") and not line.startswith("|---")]
    assert len(rows) >= 13, rows  # the prefill table (header and 8 rows) and the decode table (header and 3)
    text = README.read_text(encoding="utf-8")
    missing = [row for row in rows if row not in text]
    assert not missing, "README.md lacks these rows of `python -m benchmarks --headline`:\n" + "\n".join(missing)
