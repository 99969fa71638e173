"""mkdocs hook: the results pages, generated at build time from benchmarks/results/.

Every ``*.md`` file the studies and benchmark scripts wrote becomes the page ``results/<name>.md`` (its text
unchanged, under a line naming the files it came from), its ``.json`` and figures are published
beside it, and ``results/index.md`` lists the pages grouped by topic. Nothing here is typed by
hand, so the pages cannot drift from the files.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

_spec = importlib.util.spec_from_file_location("pyprune_docs_brackets", Path(__file__).with_name("brackets.py"))
_brackets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_brackets)

#: file-name prefix -> topic heading of the index, in the index's order (the longest prefix wins)
TOPICS = {
    "baselines": "Baselines (magnitude, Wanda, SparseGPT, ALPS, RIA, DSnoT, Taylor)",
    "crosscheck": "Cross-check against the authors' code",
    "zeroshot": "Zero-shot accuracy",
    "safe": "SAFE / SAFE⁺",
    "alps": "ALPS",
    "continual": "COPAL: continual pruning",
    "robustness": "MoreauPruner: robustness",
    "moreau": "MoreauPruner: memory",
    "dress": "DReSS",
    "owl": "OWL: layer-wise sparsity (Wanda, SparseGPT)",
    "sleb": "SLEB: block removal, beside DReSS",
    "ops": "Op speed",
    "sparse-linear": "Sparse execution: SparseLinear",
    "e2e": "Sparse execution: end to end",
    "peak-memory": "Peak memory and offload",
    "distributed": "Data-parallel speed (torchrun)",
}
FIGURES = (".svg", ".png")


def _results_dir(config) -> Path:
    return Path(config.config_file_path).parent / "benchmarks" / "results"


def _topic(stem: str) -> str:
    prefixes = [p for p in TOPICS if stem == p or stem.startswith(p + "-")]
    if not prefixes:
        raise ValueError(f"benchmarks/results/{stem}.md has no topic: add its file-name prefix to TOPICS "
                         f"in docs/hooks/results.py (known: {', '.join(TOPICS)})")
    return TOPICS[max(prefixes, key=len)]


def _owner(stem: str, pages: list[str]) -> str | None:
    """The results page a figure or JSON file belongs to: the longest page name it starts with."""
    owners = [p for p in pages if stem == p or stem.startswith(p + "-")]
    return max(owners, key=len) if owners else None


def _title(stem: str, text: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return stem


def _page(stem: str, text: str, extras: list[str]) -> str:
    """The page: a title, where it comes from, the file's text (its own title dropped), its figures."""
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    sources = [f"`benchmarks/results/{stem}.md`"] + [f"[`{name}`]({name})" for name in extras
                                                      if not name.endswith(FIGURES)]
    lines = _brackets.escape_brackets("\n".join(lines)).splitlines()
    head = [f"# {_title(stem, text)}", "",
            f"*Generated from {', '.join(sources)}, written by its study or benchmark script; not edited by hand.*", ""]
    figures = [f"![{name}]({name})" for name in extras if name.endswith(FIGURES)]
    return "\n".join(head + lines + [""] + figures) + "\n"


def _index(results: Path, titles: dict[str, str]) -> str:
    out = ["# Results", "",
           "One page per results file in `benchmarks/results/`, generated from the file at build time. "
           "The method pages interpret them.", ""]
    for topic, stems in _grouped(results).items():
        out += [f"## {topic}", ""]
        out += [f"- [{titles[stem]}]({stem}.md) (`{stem}.md`)" for stem in stems]
        out.append("")
    return "\n".join(out)


def _grouped(results: Path) -> dict[str, list[str]]:
    """The results pages' names per topic, topics in TOPICS' order."""
    by_topic: dict[str, list[str]] = {topic: [] for topic in TOPICS.values()}
    for path in sorted(results.glob("*.md")):
        by_topic[_topic(path.stem)].append(path.stem)
    return {topic: stems for topic, stems in by_topic.items() if stems}


def on_config(config):
    """Put every generated page in the navigation: the "Results" entry becomes the index and one
    section per topic."""
    results = _results_dir(config)
    section = [{"Overview": "results/index.md"}]
    for topic, stems in _grouped(results).items():
        section.append({topic: [{stem: f"results/{stem}.md"} for stem in stems]})
    entries = [i for i, item in enumerate(config.nav) if isinstance(item, dict) and "Results" in item]
    if len(entries) != 1:
        raise ValueError("mkdocs.yml's nav needs exactly one 'Results' entry for docs/hooks/results.py")
    config.nav[entries[0]] = {"Results": section}
    return config


def on_files(files, config):
    results = _results_dir(config)
    pages = sorted(p.stem for p in results.glob("*.md"))
    if not pages:
        raise FileNotFoundError(f"no results files in {results}")
    extras: dict[str, list[str]] = {stem: [] for stem in pages}
    for path in sorted(results.iterdir()):
        if path.suffix in (".json",) + FIGURES:
            owner = _owner(path.stem, pages)
            if owner is not None:
                extras[owner].append(path.name)
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    titles = {}
    for stem in pages:
        text = (results / f"{stem}.md").read_text(encoding="utf-8")
        titles[stem] = _title(stem, text)
        files.append(File.generated(config, f"results/{stem}.md", content=_page(stem, text, extras[stem])))
    files.append(File.generated(config, "results/index.md", content=_index(results, titles)))
    return files
