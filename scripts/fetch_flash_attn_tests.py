"""Write flash-attention's tests/test_flash_attn.py into tests/upstream/vendor/ (git-ignored).

The upstream file is flash-attention's, not ours: it is never committed, only fetched into the
ignored folder from which tests/upstream/conftest.py runs it against `tritonattn`. Its first line is
a comment naming where it came from and the upstream commit, which the pytest run prints in its
header and scripts/select_flash_attn_tests.py records in tests/upstream/selected.txt.

    python scripts/fetch_flash_attn_tests.py                      # from the default mirror below
    python scripts/fetch_flash_attn_tests.py --source ~/flash-attention          # a checkout
    python scripts/fetch_flash_attn_tests.py --source repo.git --rev v2.8.3      # a (bare) git dir

--source is a checkout (its work-tree file is read, with "-dirty" added to the commit when git
reports local changes to it) or a git directory (the file is read at --rev). Machines without
network (the GPU machine) cannot fetch: the file is one file so that it can travel with the work
tree (e.g. named in the device runner's `carry`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_PATH = "tests/test_flash_attn.py"
DEFAULT_SOURCE = "/work/.mirror/Dao-AILab+flash-attention/repo"
DEFAULT_DEST = REPO_ROOT / "tests" / "upstream" / "vendor" / "test_flash_attn.py"
HEADER = "# flash-attention {commit} {path} (from {source}); fetched by scripts/fetch_flash_attn_tests.py: theirs\n"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def read_upstream(source: Path, rev: str) -> Tuple[str, str]:
    """(text, commit) of tests/test_flash_attn.py from a checkout or a git directory."""
    work_tree_file = source / UPSTREAM_PATH
    if work_tree_file.is_file():
        commit = _git("-C", str(source), "rev-parse", "HEAD").strip()
        if _git("-C", str(source), "status", "--porcelain", "--", UPSTREAM_PATH).strip():
            commit += "-dirty"
        return work_tree_file.read_text(), commit
    commit = _git("--git-dir", str(source), "rev-parse", f"{rev}^{{commit}}").strip()
    return _git("--git-dir", str(source), "show", f"{commit}:{UPSTREAM_PATH}"), commit


def upstream_commit(path: Path = DEFAULT_DEST) -> Optional[str]:
    """The commit recorded in a fetched file's first line, or None if there is no such file."""
    if not path.is_file():
        return None
    first = path.read_text().split("\n", 1)[0]
    return first.split()[2] if first.startswith("# flash-attention ") else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(DEFAULT_SOURCE),
                        help=f"a flash-attention checkout or git directory (default {DEFAULT_SOURCE})")
    parser.add_argument("--rev", default="HEAD", help="revision to read from a git directory (default HEAD)")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"output file (default {DEFAULT_DEST})")
    args = parser.parse_args(argv)
    try:
        text, commit = read_upstream(args.source, args.rev)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        print(f"Cannot read {UPSTREAM_PATH} from {args.source}: {detail.strip()}", file=sys.stderr)
        return 1
    args.dest.parent.mkdir(parents=True, exist_ok=True)
    args.dest.write_text(HEADER.format(commit=commit, path=UPSTREAM_PATH, source=args.source) + text)
    print(f"wrote {args.dest} (flash-attention {commit}, {text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
