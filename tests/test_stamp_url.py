"""The repository's URL is written once (pyproject.toml, [project.urls] Repository) and stamped everywhere it is
needed by scripts/stamp_url.py: each notebook's Colab badge and setup cell, README's badges. A copy that
disagrees, a placeholder or another repository's URL fails here."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import stamp_url  # noqa: E402


def test_every_copy_agrees_with_pyproject():
    """`stamp_url.py --check` finds nothing to stamp and no stale URL."""
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "stamp_url.py"), "--check"], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_catches_a_disagreeing_copy(tmp_path, monkeypatch):
    """A notebook whose setup cell names another URL, and a placeholder in README, are reported."""
    url = stamp_url.repository_url()
    nb = json.loads((REPO / "notebooks" / "01_gqa.ipynb").read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["source"] = "".join(cell["source"]).replace(url, "https://github.com/OWNER/REPO")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_gqa.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    (tmp_path / "README.md").write_text("| `01_gqa` | x | y |\nclone https://github.com/OWNER/REPO.git\n")
    monkeypatch.setattr(stamp_url, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(stamp_url, "README", tmp_path / "README.md")
    problems = stamp_url.run(write=False)
    assert "01_gqa.ipynb: the setup cell" in problems and "README.md: the badge of 01_gqa.ipynb" in problems
    stale = stamp_url.stale_copies()
    assert "01_gqa.ipynb: a placeholder URL" in stale and "README.md: a placeholder URL" in stale
    stamp_url.run(write=True)
    assert not stamp_url.run(write=False)
    assert "01_gqa.ipynb: a placeholder URL" not in stamp_url.stale_copies()


def test_the_url_is_a_github_repository():
    """pyproject's URL is a real-looking GitHub repository URL, not a placeholder."""
    url = stamp_url.repository_url()
    assert url.startswith("https://github.com/") and "OWNER" not in url and url.count("/") == 4
