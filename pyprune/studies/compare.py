"""``pyprune compare``: several pruning reports in one markdown table and one figure.

A report is the JSON of ``pyprune prune --report`` or ``pyprune eval --report``: its method and
pattern, measured sparsity, perplexities (``eval``: [{data, perplexity}]) and zero-shot results
(``tasks``: {name: {acc, acc_norm, stderr, ...}}). The table has one row per report and one column
per metric (perplexity per text, lower is better; acc and acc_norm per task, higher is better),
the best value of each column in bold. The figure plots perplexity (log scale) and accuracy
against sparsity, one line per method and pattern kind, each starting from the dense model when
a dense report is given; it is written as PNG and SVG (matplotlib, Agg backend).
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from ..files import atomic_path

__all__ = ["load_report", "rows", "columns", "markdown_table", "plot", "compare"]


def load_report(path: str) -> Dict:
    """A report's JSON; ValueError when it holds no perplexity (``eval``: a list of entries with
    ``data`` and ``perplexity``) and no zero-shot results (``tasks``: a dict of results), e.g. a
    ``robustness`` or ``continual`` report, whose fields have other shapes."""
    with open(path, encoding="utf-8") as handle:
        try:
            report = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error})") from None
    if not isinstance(report, dict) or not (report.get("eval") or report.get("tasks")):
        raise ValueError(f"{path} is not a pyprune report with perplexities (eval) or zero-shot results (tasks)")
    entries, tasks = report.get("eval") or [], report.get("tasks") or {}
    if not (isinstance(entries, list) and all(isinstance(e, dict) and {"data", "perplexity"} <= set(e)
                                              for e in entries)
            and isinstance(tasks, dict) and all(isinstance(t, dict) for t in tasks.values())):
        raise ValueError(f"{path} is not a prune or eval report: its eval/tasks fields are not perplexity "
                         "entries and zero-shot results (a robustness or continual report?)")
    return report


def _label(report: Dict) -> tuple:
    method = report.get("method") or "dense"
    pattern = report.get("pattern") or "-"
    return method, pattern


def _protocols(reports: Sequence[Dict]) -> Dict[str, set]:
    """Text -> the (tokens, seqlen) its perplexities were measured with across ``reports``."""
    seen: Dict[str, set] = {}
    for report in reports:
        for entry in report.get("eval") or []:
            seen.setdefault(entry["data"], set()).add((entry.get("tokens"), entry.get("seqlen")))
    return seen


def _ppl_column(entry: Dict, protocols: Dict[str, set]) -> str:
    """``ppl TEXT``; perplexities of one text measured on other token counts or windows are not
    comparable, so then each protocol gets its own column (``ppl TEXT (1024 tokens, seqlen 256)``)."""
    if len(protocols[entry["data"]]) == 1:
        return f"ppl {entry['data']}"
    return f"ppl {entry['data']} ({entry.get('tokens')} tokens, seqlen {entry.get('seqlen')})"


def rows(reports: Sequence[Dict]) -> List[Dict]:
    """One row per report: method, pattern, sparsity (None when unknown), ``{column: (value,
    stderr)}`` for each perplexity and zero-shot metric, and each accuracy's chance level (None
    when the task does not state it)."""
    out = []
    protocols = _protocols(reports)
    for report in reports:
        method, pattern = _label(report)
        values, chance = {}, {}
        for entry in report.get("eval") or []:
            values[_ppl_column(entry, protocols)] = (entry["perplexity"], None)
        for task, result in sorted((report.get("tasks") or {}).items()):
            for metric in ("acc", "acc_norm"):
                if result.get(metric) is not None:
                    values[f"{task} {metric}"] = (result[metric], (result.get("stderr") or {}).get(metric))
                    chance[f"{task} {metric}"] = result.get("chance")
        sparsity = report.get("sparsity", 0.0 if method == "dense" else None)
        out.append({"method": method, "pattern": pattern, "sparsity": sparsity, "values": values,
                    "chance": chance})
    return out


def columns(table_rows: Sequence[Dict]) -> List[str]:
    """Every metric column, in first-seen order (perplexities first)."""
    seen: List[str] = []
    for row in table_rows:
        for name in row["values"]:
            if name not in seen:
                seen.append(name)
    return sorted(seen, key=lambda name: not name.startswith("ppl "))


def _lower_is_better(column: str) -> bool:
    return column.startswith("ppl ")


def _best(table_rows: Sequence[Dict], column: str) -> Optional[float]:
    values = [row["values"][column][0] for row in table_rows if column in row["values"]]
    if not values:
        return None
    return min(values) if _lower_is_better(column) else max(values)


def markdown_table(table_rows: Sequence[Dict]) -> str:
    """The markdown table: method, pattern, sparsity, then every metric; the best value of each
    column (ties included) in bold, accuracies with their standard error."""
    cols = columns(table_rows)
    best = {column: _best(table_rows, column) for column in cols}
    lines = ["| method | pattern | sparsity | " + " | ".join(cols) + " |",
             "|---|---|---:|" + "---:|" * len(cols)]
    for row in table_rows:
        cells = [row["method"], row["pattern"], "–" if row["sparsity"] is None else f"{row['sparsity']:.3f}"]
        for column in cols:
            if column not in row["values"]:
                cells.append("–")
                continue
            value, stderr = row["values"][column]
            text = f"{value:.2f}" if _lower_is_better(column) else f"{value:.3f}"
            if value == best[column]:
                text = f"**{text}**"
            if stderr is not None:
                text += f" ± {stderr:.3f}"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _series_key(row: Dict) -> str:
    pattern = row["pattern"]
    kind = pattern if ":" in pattern else pattern.split(" ")[0]
    return f"{row['method']} ({kind})"


def plot(table_rows: Sequence[Dict], stem: str, title: str = "") -> List[str]:
    """Perplexity (log scale) and accuracy against sparsity, one panel per metric column (acc
    only, not acc_norm), one line per method and pattern kind from the dense row when there is
    one; writes ``stem``.png and ``stem``.svg and returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in columns(table_rows) if not c.endswith(" acc_norm")]
    if not cols:
        raise ValueError("nothing to plot: the reports hold no perplexity or accuracy")
    dense = [row for row in table_rows if row["method"] == "dense"]
    pruned = [row for row in table_rows if row["method"] != "dense" and row["sparsity"] is not None]
    series: Dict[str, List[Dict]] = {}
    for row in pruned:
        series.setdefault(_series_key(row), []).append(row)
    ncols = math.ceil(math.sqrt(len(cols)))
    nrows = math.ceil(len(cols) / ncols)
    figure, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for index, column in enumerate(cols):
        ax = axes[index // ncols][index % ncols]
        for label, members in series.items():
            points = [(row["sparsity"], row["values"][column][0]) for row in dense[:1] + members
                      if column in row["values"]]
            points.sort()
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        for row in dense[:1]:
            if column in row["values"]:
                ax.axhline(row["values"][column][0], color="gray", linestyle=":", linewidth=1, label="dense")
        chance = next((row["chance"][column] for row in table_rows if row["chance"].get(column)), None)
        if chance is not None:
            ax.axhline(chance, color="black", linestyle="--", linewidth=1, label="chance")
        if _lower_is_better(column):
            ax.set_yscale("log")
            plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.set_ylabel("perplexity (log scale)")
            ax.set_title(column[len("ppl "):], fontsize=10)
        else:
            ax.set_ylabel(column.rsplit(" ", 1)[1])
            ax.set_title(column.rsplit(" ", 1)[0], fontsize=10)
        ax.set_xlabel("sparsity")
        ax.grid(True, which="both", alpha=0.3)
    for index in range(len(cols), nrows * ncols):
        axes[index // ncols][index % ncols].axis("off")
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    # below the panels, at most two entries per panel column in a row, and the saved canvas grown
    # to hold it (bbox_inches="tight"): long labels never run off the figure's edge
    figure.legend(list(legend.values()), list(legend), loc="upper center", bbox_to_anchor=(0.5, 0),
                  ncol=min(len(legend), 2 * ncols), frameon=False)
    paths = []
    for ext in ("png", "svg"):
        path = f"{stem}.{ext}"
        with atomic_path(path) as tmp, plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text
            figure.savefig(tmp, dpi=110, format=ext, bbox_inches="tight")
        paths.append(path)
    plt.close(figure)
    return paths


def compare(reports: Sequence[Dict], output_dir: str, name: str = "compare", title: str = "") -> Dict[str, str]:
    """Write ``name``.md (the table), ``name``.png and ``name``.svg (the figure) into
    ``output_dir``, atomically; returns their paths."""
    table_rows = rows(reports)
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, name)
    markdown = f"{stem}.md"
    with atomic_path(markdown) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(markdown_table(table_rows))
    png, svg = plot(table_rows, stem, title)
    return {"markdown": markdown, "png": png, "svg": svg}
