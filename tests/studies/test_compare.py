"""pyprune compare: reports -> one markdown table with the best of each column in bold, and the
figure as PNG and SVG."""
import json

import pytest

from pyprune import cli
from pyprune.studies import compare


def _report(method, pattern, sparsity, ppl, acc, acc_norm=None):
    report = {"eval": [{"data": "pride_and_prejudice", "perplexity": ppl}],
              "tasks": {"austen_continuation": {"acc": acc, "acc_norm": acc_norm, "stderr": {"acc": 0.05},
                                                "chance": 0.25}}}
    if method != "dense":
        report.update({"method": method, "pattern": pattern, "sparsity": sparsity})
    return report


REPORTS = [_report("dense", None, None, 27.5, 0.80, 0.70), _report("wanda", "unstructured 0.5", 0.5, 50.9, 0.60),
           _report("sparsegpt", "2:4", 0.5, 58.1, 0.62, 0.75), _report("taylor", "structured 0.2", 0.145, 58.7, 0.62)]


def _cells(table, method):
    line = next(line for line in table.splitlines() if line.startswith(f"| {method} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_marks_the_best_of_each_column():
    table = compare.markdown_table(compare.rows(REPORTS))
    header = table.splitlines()[0]
    assert header == ("| method | pattern | sparsity | ppl pride_and_prejudice | austen_continuation acc | "
                      "austen_continuation acc_norm |")
    assert _cells(table, "dense") == ["dense", "-", "0.000", "**27.50**", "**0.800** ± 0.050", "0.700"]
    assert _cells(table, "wanda") == ["wanda", "unstructured 0.5", "0.500", "50.90", "0.600 ± 0.050", "–"]
    assert _cells(table, "sparsegpt")[5] == "**0.750**"  # highest acc_norm, where the others lack it
    assert _cells(table, "taylor")[4] == "0.620 ± 0.050" == _cells(table, "sparsegpt")[4]  # tie, not best
    assert table.count("**") == 2 * 3


def test_perplexities_of_other_protocols_get_their_own_columns():
    """2048 and 1024 evaluation tokens of one text are two measurements, not one column with a best."""
    long, short = _report("dense", None, None, 27.5, 0.8), _report("wanda", "2:4", 0.5, 26.0, 0.6)
    long["eval"][0].update(tokens=2048, seqlen=256)
    short["eval"][0].update(tokens=1024, seqlen=256)
    table = compare.markdown_table(compare.rows([long, short]))
    assert table.splitlines()[0].startswith("| method | pattern | sparsity | ppl pride_and_prejudice (2048 tokens, "
                                            "seqlen 256) | ppl pride_and_prejudice (1024 tokens, seqlen 256) |")
    assert _cells(table, "dense")[3:5] == ["**27.50**", "–"] and _cells(table, "wanda")[3:5] == ["–", "**26.00**"]
    short["eval"][0]["tokens"] = 2048  # one protocol: one column, as before
    assert "ppl pride_and_prejudice |" in compare.markdown_table(compare.rows([long, short])).splitlines()[0]


def test_ties_for_best_are_all_marked():
    reports = [_report("wanda", "2:4", 0.5, 40.0, 0.5), _report("sparsegpt", "2:4", 0.5, 40.0, 0.4)]
    table = compare.markdown_table(compare.rows(reports))
    assert _cells(table, "wanda")[3] == _cells(table, "sparsegpt")[3] == "**40.00**"


def test_figure_files_are_written(tmp_path):
    written = compare.compare(REPORTS, str(tmp_path / "out"), name="cmp", title="test")
    assert written["png"].endswith("cmp.png") and written["svg"].endswith("cmp.svg")
    assert open(written["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    svg = open(written["svg"]).read()
    for label in ("wanda (unstructured)", "sparsegpt (2:4)", "taylor (structured)", "chance", "dense"):
        assert label in svg
    assert open(written["markdown"]).read() == compare.markdown_table(compare.rows(REPORTS))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cmp.md", "cmp.png", "cmp.svg"]


def test_cli_compare(tmp_path, capsys):
    paths = []
    for index, report in enumerate(REPORTS):
        path = tmp_path / f"r{index}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    assert cli.main(["compare", *paths, "--output", str(tmp_path / "cmp")]) == 0
    assert "**27.50**" in capsys.readouterr().out
    assert (tmp_path / "cmp" / "compare.png").exists() and (tmp_path / "cmp" / "compare.svg").exists()


@pytest.mark.parametrize("content, message", [("{", "not JSON"), ('{"model": "m"}', "not a pyprune report")])
def test_cli_compare_refuses_what_is_not_a_report(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert cli.main(["compare", str(path), "--output", str(tmp_path / "cmp")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()
