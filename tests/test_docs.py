"""The docs: the site builds strictly (every link, page and docstring resolves), it has one results
page per results file and an API entry per public module, and the README stays short and quotes only
results files that exist."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
#: a Markdown link's target, relative links only
LINK = re.compile(r"\]\((?!https?://|#)([^)\s]+)\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_docs_build_strictly_with_a_page_per_results_file(site):
    stems = sorted(path.stem for path in RESULTS.glob("*.md"))
    assert stems, "no results files in benchmarks/results"
    index = (site / "results" / "index.html").read_text(encoding="utf-8")
    for stem in stems:
        page = site / "results" / stem / "index.html"
        assert page.is_file(), f"no generated results page for benchmarks/results/{stem}.md"
        assert f"benchmarks/results/{stem}.md" in page.read_text(encoding="utf-8")
        assert f'href="{stem}/"' in index, f"results/index does not link {stem}"


def test_every_public_module_is_rendered_on_its_api_page(site):
    """Each module of pyprune/ with no part of its name starting with ``_`` has its entry on the page
    of its top-level package or module (``pyprune`` itself on the index)."""
    modules = []
    for path in sorted((ROOT / "pyprune").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts):
            modules.append(parts)
    assert ("pyprune", "methods", "sleb") in modules and ("pyprune", "files") in modules
    for parts in modules:
        page = site / "api" / (parts[1] if len(parts) > 1 else ".") / "index.html"
        assert f'id="{".".join(parts)}"' in page.read_text(encoding="utf-8"), \
            f"{'.'.join(parts)} is not rendered on {page.relative_to(site)}"


def test_readme_is_short_and_links_only_files_that_exist():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 220, f"README.md has {len(text.splitlines())} lines; at most 220"
    targets = [target.split("#")[0] for target in LINK.findall(text)]
    assert any(t.startswith("benchmarks/results/") for t in targets), "README links no results file"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links paths that do not exist: {missing}"


def test_readme_table_numbers_come_from_the_linked_results_file():
    """Every decimal in a README table row that links a results file appears in that file."""
    rows = [line for line in README.read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and "](benchmarks/results/" in line]
    assert rows, "README has no table row linking a results file"
    for row in rows:
        files = re.findall(r"\]\((benchmarks/results/[^)]+)\)", row)
        text = "".join((ROOT / f).read_text(encoding="utf-8") for f in files)
        cells = re.sub(r"\[[^\]]*\]\([^)]*\)", "", row)
        for number in re.findall(r"\d+\.\d+", cells):
            assert number in text, f"README number {number} is not in {files}: {row}"
