"""The repository's shape: the README's "Where things are" table matches the tree, and modules stay short."""

import re

from tests.conftest import ROOT

MAX_MODULE_LINES = 400


def readme_table_paths() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Where things are"):]
    table = table[:table.index("\n## ")]
    paths = set()
    for cell in re.findall(r"^\| \**`([^`]+)`", table, flags=re.M):
        top = cell.split("/")[0]
        paths.add(cell if top in ("meshtrain", "launch", "bench", "tests", "configs") else f"meshtrain/{cell}")
    return paths


def test_readme_table_lists_every_module_and_nothing_else():
    listed = readme_table_paths()
    missing = [p for p in listed if not (ROOT / p).exists()]
    assert not missing, f"the README's table names paths that do not exist: {missing}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "meshtrain").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "meshtrain").rglob("__init__.py")} - {"meshtrain/"}
    unlisted = sorted((modules | packages) - listed)
    assert not unlisted, f"modules or packages missing from the README's table: {unlisted}"


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "meshtrain").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these along their seams: {long}"
