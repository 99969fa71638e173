"""The docs: the site builds strictly (every link, page and docstring resolves), it has one results
page per results file and an API entry per public module, the README stays short and quotes only
results files that exist, and every number in the README and the docs pages is in the results file it
cites (docs/hooks/numbers.py)."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyprune.studies.verdict import paired_verdict

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


def test_the_install_page_gives_the_readme_s_commands_and_ci_runs_them():
    """One test command: the README's (which .ci/run runs) is the install page's, word for word."""
    import re
    commands = re.findall(r"^pip install .*$", README.read_text(encoding="utf-8"), flags=re.M)
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert commands and all(command in install for command in commands), commands
    test_command = next(command for command in commands if "pytest" in command)
    assert test_command.split("&& ")[-1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_is_short_and_links_only_files_that_exist():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 220, f"README.md has {len(text.splitlines())} lines; at most 220"
    targets = [target.split("#")[0] for target in LINK.findall(text)]
    assert any(t.startswith("benchmarks/results/") for t in targets), "README links no results file"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links paths that do not exist: {missing}"


def _numbers_hook():
    spec = importlib.util.spec_from_file_location("pyprune_docs_numbers", ROOT / "docs" / "hooks" / "numbers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


numbers_hook = _numbers_hook()


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in numbers_hook.pages()])
def test_every_number_is_in_the_results_file_it_cites(page):
    """README.md and every docs page: each number (docs/hooks/numbers.py says which) is in the results
    file its block cites."""
    misses = numbers_hook.check((ROOT / page).read_text(encoding="utf-8"), page)
    assert not misses, f"{len(misses)} numbers not in their cited files:\n" + "\n".join(map(str, misses))


def test_a_number_not_in_its_file_fails():
    """The check on the README as it is, and with one number changed, one citation dropped."""
    text = README.read_text(encoding="utf-8")
    assert "55.72 ± 0.29" in text and not numbers_hook.check(text, "README.md")
    wrong = numbers_hook.check(text.replace("55.72 ± 0.29", "55.82 ± 0.29"), "README.md")
    assert [m.number for m in wrong] == ["55.82"] and wrong[0].files == ("safe-controls-smollm2-135m",)
    flipped = numbers_hook.check(text.replace("SAFE⁺ − control is −1.19", "SAFE⁺ − control is +1.19"),
                                 "README.md")
    assert [m.number for m in flipped] == ["+1.19"]
    uncited = numbers_hook.check(text.replace("([Gemma](benchmarks/results/baselines-gemma3-270m.md))", ""),
                                 "README.md")
    # the Gemma paragraph now continues the citation of the paragraph before it, whose files lack its numbers
    assert {m.number for m in uncited} == {"38744160.95", "265.24", "106.49", "100.52", "983.58"}
    assert all(m.files == ("safe-smollm2-135m-tuning-text", "safe-smollm2-135m", "safe-controls-smollm2-135m-full",
                           "safe-controls-smollm2-135m-full-epochs6") for m in uncited)


def test_what_counts_as_a_cited_number():
    cite = "[r](../results/safe-controls-smollm2-135m.md)"
    ok = [f"{cite} SAFE⁺ reaches 55.723, 55.72, 55.7 and −1.19 ± 1.22 (mask moved 0.0023%).",
          f"## A section\n\n{cite} cited here.\n\n| arm | ppl |\n|---|---:|\n| safe+ | 56.04 |\n\n"
          "The next paragraph continues it: 5.7·10⁻⁷.",
          "No citation, no numbers but counts and sizes: 16 × 128 tokens, 3 seeds, 2:4, block 15, 93 MB.",
          f"{cite} Times and factors: 790 s, an Adam step 6236× as far.",
          "Settings and code are not results: lr 5e-3, `--rho 0.0002`\n\n```bash\npip install torch==2.13.0\n```"]
    for text in ok:
        assert numbers_hook.check(text, "page") == [], text
    bad = {f"{cite} 55.73": "55.73",                         # rounds to no value in the file
           f"{cite} −55.72": "−55.72",                       # the file has it positive
           f"{cite} 4.2·10⁻⁹ of the norm": "4.2·10⁻⁹",
           f"{cite}\n\n## Next section\n\n55.72": "55.72",  # a citation ends with its section
           "Uncited: 1.5× faster": "1.5",
           f"{cite} it took 791 s": "791",                   # an integer time is a measurement
           "Uncited: 12× slower": "12"}
    for text, number in bad.items():
        assert [m.number for m in numbers_hook.check(text, "page")] == [number], text
    with pytest.raises(FileNotFoundError):
        numbers_hook.check("[r](../results/no-such-file.md) 1.0", "page")


def _rows(name: str, key: str = "rows") -> list[dict]:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))[key]


def _safe_controls(pattern: str, arm: str, against: str, name: str = "safe-controls-smollm2-135m") -> str:
    rows = [r for r in _rows(name) if r["pattern"] == pattern]
    side = lambda name: {r["seed"]: r["perplexity"] for r in rows if r["arm"] == name}  # noqa: E731
    return paired_verdict(side(arm), side(against)).word


def _robustness(arithmetic: str, against: str, metric: str, ratio: float = 0.2,
                name: str = "robustness-smollm2-135m") -> str:
    """MoreauPruner against ``against`` at ``ratio`` of every layer; agreement: higher is better."""
    runs = [r for r in _rows(name, "runs")
            if r["arithmetic"] == arithmetic and r["layers"] == "all" and r["overall_ratio"] == ratio]
    side = lambda name: {r["seed"]: r[metric] for r in runs if r["method"] == name}  # noqa: E731
    return paired_verdict(side("moreau"), side(against), lower_is_better=metric != "agreement").word


def _copal(metric: str) -> str:
    """COPAL gaussian per row against cumulative Wanda over calibration seeds (A-BWT: less forgetting is better)."""
    rows = _rows("continual-smollm2-135m-unstructured50-seeds")
    side = lambda method: {p["seed"]: p[metric] for r in rows if r["method"].startswith(method)  # noqa: E731
                           for p in r["per_seed"]}
    return paired_verdict(side("copal"), side("wanda")).word


def _dress(name: str, arm: str, text: str, steps: int = 150, channels: str = "quiet") -> str:
    """A DReSS arm against slice-then-train (N&P&R), lr 1e-3, ``steps`` training steps, over training seeds."""
    rows = [r for r in _rows(name) if r.get("channels", "quiet") == channels and r["lr"] == 0.001
            and r["train_steps"] == steps]
    side = lambda label: {r.get("train_seed") or 0: r["ppl_sliced"][text] for r in rows  # noqa: E731
                          if r["label"] == label}
    return paired_verdict(side(arm), side("slice, then train (N&P&R)")).word


#: (words in the README, the verdict they state, the verdict the rule gives on the results file)
README_VERDICTS = [
    ("against that control ADMM is unsettled at 50%", "unsettled",
     lambda: _safe_controls("unstructured 0.5", "safe+", "masked-recon wanda")),
    ("and behind at 2:4 and 4:8", "behind", lambda: _safe_controls("2:4", "safe+", "masked-recon wanda")),
    ("and behind at 2:4 and 4:8", "behind", lambda: _safe_controls("4:8", "safe+", "masked-recon wanda")),
    ("Plain SAFE is behind its control", "behind",
     lambda: _safe_controls("unstructured 0.5", "safe", "masked-recon magnitude")),
    ("(SAFE⁺ − box −0.56 ± 0.72: unsettled)", "unsettled",
     lambda: _safe_controls("unstructured 0.5", "safe+", "safe+ dual_init=box")),
    ("it is ahead of Taylor in agreement", "ahead", lambda: _robustness("fp32-accumulate", "taylor", "agreement")),
    ("ahead of Taylor and of SmoothGrad", "ahead", lambda: _robustness("fp32-accumulate", "taylor", "ppl_diff")),
    ("ahead of Taylor and of SmoothGrad", "ahead",
     lambda: _robustness("fp32-accumulate", "smoothgrad-gradients", "ppl_diff")),
    ("against SmoothGrad's agreement (0.9887 ± 0.0027) it is unsettled", "unsettled",
     lambda: _robustness("fp32-accumulate", "smoothgrad-gradients", "agreement")),
    ("Rounded weights: both metrics unsettled", "unsettled", lambda: _robustness("rounding", "taylor", "agreement")),
    ("Rounded weights: both metrics unsettled", "unsettled", lambda: _robustness("rounding", "taylor", "ppl_diff")),
    *[(words, "unsettled", lambda against=against, metric=metric, ratio=ratio: _robustness(
        "fp32-accumulate", against, metric, ratio, "robustness-smollm2-135m-channels"))
      for words, metric in (("14.37 ± 4.63: unsettled", "ppl_diff"), ("its agreement is unsettled against both", "agreement"))
      for against in ("taylor", "smoothgrad-gradients") for ratio in (0.1, 0.2)],
    ("0.07 ± 0.00 against Taylor's 0.08 ± 0.01, unsettled", "unsettled",
     lambda: _robustness("native", "taylor", "ppl_diff", 0.1, "robustness-smollm2-135m-channels")),
    ("19.51 ± 15.28 against 1.90 ± 1.49, unsettled by the paper's metric", "unsettled",
     lambda: _robustness("native", "taylor", "ppl_diff", 0.2, "robustness-smollm2-135m-channels")),
    ("SAFE⁺ 2:4 is behind it on both", "behind",
     lambda: _safe_controls("2:4", "safe+", "masked-recon wanda", "safe-controls-smollm2-135m-full")),
    ("unsettled turns behind", "behind",
     lambda: _safe_controls("unstructured 0.5", "safe+", "masked-recon wanda", "safe-controls-smollm2-135m-full")),
    ("not 0.11%, is behind too", "behind",
     lambda: _safe_controls("2:4", "safe+ lam_schedule=cosine", "masked-recon wanda", "safe-controls-smollm2-135m-full")),
    ("at 50% (1.7% moved) the ramp is behind as well", "behind",
     lambda: _safe_controls("unstructured 0.5", "safe+ lam_schedule=cosine", "masked-recon wanda",
                            "safe-controls-smollm2-135m-full")),
    ("SAFE⁺ is still behind its control", "behind",
     lambda: _safe_controls("2:4", "safe+", "masked-recon wanda", "safe-controls-smollm2-135m-full-epochs6")),
    ("COPAL behind on every seed", "behind", lambda: _copal("a_ppl")),
    ("more on seed 1, unsettled", "unsettled", lambda: _copal("a_bwt")),
    ("the two are unsettled on Pride and Prejudice", "unsettled",
     lambda: _dress("dress-smollm2-135m", "DReSS-l2 proximal", "pride_and_prejudice")),
    ("unsettled on Pride and Prejudice (58.50 ± 1.69 against 59.12 ± 1.98 for slice-then-train; lower on two seeds "
     "of three) and on Moby Dick", "unsettled",
     lambda: _dress("dress-smollm2-135m", "DReSS-l2 proximal", "moby_dick")),
    ("both texts are unsettled again", "unsettled",
     lambda: _dress("dress-smollm2-135m-mixed", "DReSS-l2 proximal", "pride_and_prejudice")),
    ("both texts are unsettled again", "unsettled",
     lambda: _dress("dress-smollm2-135m-mixed", "DReSS-l2 proximal", "moby_dick")),
    ("is behind slice-then-train on both texts", "behind",
     lambda: _dress("dress-smollm2-135m", "DReSS-l2", "pride_and_prejudice")),
    ("is behind slice-then-train on both texts", "behind",
     lambda: _dress("dress-smollm2-135m", "DReSS-l2", "moby_dick")),
    *[("the proximal arm is ahead of slice-then-train by the rule on both texts over three seeds", "ahead",
       lambda text=text: _dress(
        "dress-smollm2-135m", "DReSS-l2 proximal", text, channels="last")) for text in ("pride_and_prejudice", "moby_dick")],
    *[("the two are unsettled by the rule over three seeds", "unsettled", lambda text=text: _dress(
        "dress-smollm2-135m-1800-windows", "DReSS-l2", text, steps=450)) for text in ("pride_and_prejudice", "moby_dick")],
]


@pytest.mark.parametrize("words, stated, computed", README_VERDICTS)
def test_the_readme_compares_arms_over_seeds_in_the_verdict_rule_s_words(words, stated, computed):
    """Each README sentence that calls an arm ahead, behind or unsettled over seeds says what
    pyprune.studies.verdict gives on the paired rows of its results file."""
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert words in readme, f"the README no longer says {words!r}: update README_VERDICTS with it"
    assert stated in words
    assert computed() == stated, f"the README says {stated!r} ({words!r}); the rule gives {computed()!r}"
