"""The repository's shape: docs/architecture.md's module table matches the tree, the README's links
lead somewhere, modules stay short, and test modules share helpers through modules of their own."""

import re

from tests.conftest import ROOT

MAX_MODULE_LINES = 400


def architecture_table_paths() -> set[str]:
    table = (ROOT / "docs" / "architecture.md").read_text()
    paths = set()
    for cell in re.findall(r"^\| \**`([^`]+)`", table, flags=re.M):
        top = cell.split("/")[0]
        paths.add(cell if top in ("meshtrain", "launch", "bench", "tests", "configs") else f"meshtrain/{cell}")
    return paths


def test_the_architecture_table_lists_every_module_and_nothing_else():
    listed = architecture_table_paths()
    missing = [p for p in listed if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md's table names paths that do not exist: {missing}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "meshtrain").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "meshtrain").rglob("__init__.py")} - {"meshtrain/"}
    unlisted = sorted((modules | packages) - listed)
    assert not unlisted, f"modules or packages missing from docs/architecture.md's table: {unlisted}"


def test_the_readme_is_one_page_whose_links_and_test_paths_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 100, "the README is one page: details go to docs/"
    targets = re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"`(tests/test_\w+\.py)`", text)
    assert targets and not [t for t in targets if not (ROOT / t).exists()]
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{doc.name})" in text, f"docs/{doc.name} is not linked from the README"


def test_test_modules_do_not_import_each_other():
    """Shared helpers live in tests/parity.py, tests/hf_models.py, tests/chat_data.py, conftest.py ...:
    a test file imported by others runs its module-level code (and its jobs' definitions) there too."""
    importers = {str(p.relative_to(ROOT)): found for p in (ROOT / "tests").rglob("*.py")
                 if (found := re.findall(r"^\s*from tests\.(test_\w+)", p.read_text(), flags=re.M))}
    assert not importers, importers


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "meshtrain").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these along their seams: {long}"
