"""mkdocs hook and docs test: every number a page types is in the results file it cites.

**What a page cites.** A page is read block by block: a paragraph, a list item, a table row (code
blocks and headings are not blocks; a heading starts a section). A block cites the results files it
links (``benchmarks/results/NAME.md`` or ``.json`` from the README, ``../results/NAME.md`` from a docs
page); a block that links none cites what the last citing block of its section cited, so a table or
a paragraph continues the citation of the paragraph that introduced it. A number in a block that
cites nothing is an error, as is a number its files do not hold.

**What a number is.** A decimal (``55.72``, ``+1.76``, ``−1.19``, ``2.22×``, ``0.0023%``), a
power of ten (``5.7·10⁻⁷``), or an integer that is a time or a factor (``618 s``, ``34 minutes``,
``6236×``), in prose, tables and link text. Excluded, and only these:

* code: fenced blocks and inline code spans (commands, options, versions, settings such as
  ``--lr 5e-3``);
* settings in ``e`` notation (``lr 5e-3``, ``ρ = 2e-4``, ``λ 1e-3``, a tolerance ``1e-6``): the
  results files write measurements in decimals or ``·10⁻ⁿ``, the docs write settings this way;
* other integers: counts, sizes and shapes (16 × 256 tokens, 3 seeds, block 15, 2:4, 93 MB,
  SmolLM2-135M);
* quotations: text in double quotes is a paper's or its code's (the paper: "perplexity
  95.8 in bf16"), not this project's measurement.

**Present in a file** means: the file (its ``.md`` or its ``.json``) holds a number that, rounded
to the digits typed, is the number typed; a signed number must match the sign, an unsigned one
matches either; a percentage also matches the file's fraction (98.4% and 0.984).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
log = logging.getLogger("mkdocs.plugins.pyprune_numbers")

_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
#: a typed number: optional sign (a minus or plus not glued to a word), digits, an optional
#: exponent (``e-3`` or ``·10⁻⁷``), not part of a word (``fp32``, ``135M``, ``x₀``) or of a version
#: (``0.4.13``)
_NUMBER = re.compile(r"(?P<sign>(?<![\w.])[+\-−])?(?<![\w.])(?P<digits>\d+(?:\.\d+)?)"
                     r"(?:e(?P<exp>[+\-−]?\d+)|·10(?P<sup>⁻?[⁰¹²³⁴⁵⁶⁷⁸⁹]+))?(?P<percent>%)?(?!\w|\.\d)")
_FILE_NUMBER = re.compile(r"[+\-]?\d+(?:\.\d+)?(?:[eE][+\-]?\d+)?")
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"``.*?``|`[^`]*`")
_QUOTE = re.compile(r'"[^"\n]*"|“[^”\n]*”')
_ITEM = re.compile(r"\s*(?:[-*]|\d+\.) ")
#: what makes an integer a measurement: a unit of time after it, or a factor (× not starting a shape)
_MEASURED = re.compile(r"\s?(?:s|ms|µs|min|minutes|hours?)\b|×(?!\s?\d)")


@dataclass(frozen=True)
class Miss:
    """A number a page types that its cited files do not hold (``files`` empty: it cites none)."""
    page: str
    number: str
    files: tuple[str, ...]
    context: str

    def __str__(self) -> str:
        where = ", ".join(self.files) if self.files else "no results file cited"
        return f"{self.page}: {self.number} not in {where}: …{self.context}…"


def blocks(text: str) -> list[tuple[int, str]]:
    """(section number, block text) for every paragraph, list item and table row outside code."""
    out: list[tuple[int, str]] = []
    section, current, fenced = 0, [], False

    def flush():
        if current:
            out.append((section, " ".join(current)))
            current.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#") or not line.strip():
            flush()
            section += line.startswith("#")
            continue
        if line.startswith("|"):
            flush()
            out.append((section, line))
            continue
        if _ITEM.match(line):
            flush()
        current.append(line)
    flush()
    return out


def cited(block: str) -> tuple[str, ...]:
    """The results files a block links outside code, by name (``safe-controls-smollm2-135m``; the
    results index is no results file)."""
    names = []
    for _, target in _LINK.findall(_CODE_SPAN.sub("", block)):
        path = target.split("#")[0]
        if "results/" in path and path.endswith((".md", ".json")) and Path(path).stem != "index":
            names.append(Path(path).stem)
    return tuple(dict.fromkeys(names))


def typed_numbers(block: str):
    """The numbers a block types (``re.Match`` objects on the block without code, quotations and link
    targets)."""
    prose = _QUOTE.sub("", _CODE_SPAN.sub("", block))
    prose = _LINK.sub(lambda m: m.group(1), prose)
    for match in _NUMBER.finditer(prose):
        if match.group("exp"):
            continue  # a setting in e notation
        if "." in match.group("digits") or match.group("sup") or _MEASURED.match(prose, match.end()):
            yield match


@lru_cache(maxsize=None)
def file_numbers(name: str) -> tuple[float, ...]:
    """Every number in ``benchmarks/results/NAME.md`` and ``NAME.json`` (the JSON's values and the
    numbers inside its strings)."""
    values: set[float] = set()
    paths = [RESULTS / f"{name}{ext}" for ext in (".md", ".json")]
    if not any(p.is_file() for p in paths):
        raise FileNotFoundError(f"benchmarks/results/{name}.md is cited but does not exist")
    for path in paths:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                text = json.dumps(json.loads(text), ensure_ascii=False)  # floats in full
            values.update(float(m) for m in _FILE_NUMBER.findall(text))
    return tuple(sorted(values))


def _value(match) -> tuple[float, float]:
    """The typed number's value and half its last digit's unit (the rounding it allows)."""
    digits = match.group("digits")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    exponent = int(match.group("sup").translate(_SUPERSCRIPT)) if match.group("sup") else 0
    value = float(digits) * 10.0 ** exponent
    if match.group("sign") in ("-", "−"):
        value = -value
    return value, 0.5 * 10.0 ** (exponent - decimals) * (1 + 1e-9)


def present(match, values: tuple[float, ...]) -> bool:
    """Whether ``values`` holds the typed number, rounded to the digits typed."""
    value, tolerance = _value(match)
    targets = [(value, tolerance)] + ([(value / 100, tolerance / 100)] if match.group("percent") else [])
    signed = bool(match.group("sign"))
    return any(abs(v - target) <= tol or (not signed and abs(v + target) <= tol)
               for target, tol in targets for v in values)


def check(text: str, page: str) -> list[Miss]:
    """The numbers of a page (``text``, named ``page`` in messages) not found in the files it cites."""
    misses: list[Miss] = []
    current_section, running = 0, ()
    for section, block in blocks(text):
        if section != current_section:
            current_section, running = section, ()  # a citation ends with its section
        running = cited(block) or running
        files = running
        values = tuple(v for name in files for v in file_numbers(name))
        for match in typed_numbers(block):
            if not files or not present(match, values):
                start = max(0, match.start() - 50)
                misses.append(Miss(page, match.group(0), files, match.string[start:match.end() + 10]))
    return misses


def pages() -> list[Path]:
    """The README and every hand-written docs page."""
    docs = ROOT / "docs"
    return [ROOT / "README.md"] + sorted(p for p in docs.rglob("*.md") if docs / "hooks" not in p.parents)


def on_page_markdown(markdown, page, config, files):
    """A docs page with a number not in the results file it cites warns, so ``--strict`` fails."""
    source = page.file.abs_src_path
    if source is None:
        return markdown  # generated pages: the results files themselves
    for miss in check(markdown, Path(source).resolve().relative_to(ROOT).as_posix()):
        log.warning(str(miss))
    return markdown
