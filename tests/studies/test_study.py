"""The study framework: typed settings, the registry, the one runner (resume, refusal of other
settings), the ``pyprune study`` command line."""
import json

import pytest

from pyprune import cli, studies
from pyprune.io.storage import StateError
from pyprune.runtime.checkpoint import read_results
from pyprune.studies.robustness import Robustness
from pyprune.studies.study import Arm, Study, run
from pyprune.methods.options import option


def test_settings_are_typed_and_a_bad_one_names_the_option_and_what_it_allows():
    study = studies.get("robustness", seeds=[3, 4], ratios=[0.1], noise_floor="false")
    assert (study.seeds, study.ratios, study.noise_floor) == ((3, 4), (0.1,), False)
    with pytest.raises(AttributeError, match="option seeds of study 'robustness' is set when the study is built"):
        study.seeds = (0,)
    assert study.methods == ("taylor", "moreau")  # the default
    with pytest.raises(ValueError, match="option methods of study 'robustness' must be one of taylor, smoothgrad, "
                                         "smoothgrad-gradients, moreau, moreau-gs, moreau-gs-released; got 'x'"):
        studies.get("robustness", methods=["taylor", "x"])
    with pytest.raises(ValueError, match="option seeds of study 'robustness' must be a non-empty list of int; got 3"):
        studies.get("robustness", seeds=3)
    with pytest.raises(ValueError, match=r"option ratios of study 'robustness' must be in \(0, 1\]; got 1.5"):
        studies.get("robustness", ratios=[1.5])
    with pytest.raises(ValueError, match="study 'robustness' has no option seed; its options: model, methods, "):
        studies.get("robustness", seed=0)
    with pytest.raises(ValueError, match="hidden removes hidden channels in every layer"):
        studies.get("robustness", structure="hidden", layers="middle")
    with pytest.raises(ValueError, match=f"study must be one of {', '.join(studies.STUDIES)}; got 'nope'"):
        studies.get("nope")


def test_a_study_records_the_command_of_its_settings():
    assert Robustness().command() == "pyprune study robustness"
    assert Robustness(methods=["moreau-gs"], seeds=[0], noise_floor=False, model="my dir").command() == \
        "pyprune study robustness --model 'my dir' --methods moreau-gs --seeds 0 --noise-floor false"


class Squares(Study):
    """A study of squares: an arm per number, its row the square (for the runner's tests)."""

    name = "squares"
    numbers: "tuple[int, ...]" = option((1, 2), "the numbers")
    offset: int = option(0, "added to every square")
    ran: list = []

    def protocol(self, context):
        return {"offset": self.offset}

    def arms(self, context):
        return [Arm(n, f"{n}") for n in self.numbers]

    def row_key(self, row):
        return row["n"]

    def run_arm(self, context, arm, row, checkpoint):
        self.ran.append(arm.key)
        return {"n": arm.key, "square": arm.key ** 2 + self.offset}

    def markdown(self, result):
        return "".join(f"| {row['n']} | {row['square']} |\n" for row in result["rows"])


def test_the_runner_writes_after_every_arm_resumes_and_refuses_a_file_of_other_settings(tmp_path):
    path = tmp_path / "squares.json"
    Squares.ran = []
    result = run(Squares(numbers=[1, 2]), str(path))
    assert result == json.loads(path.read_text()) == {"settings": {"offset": 0},
                                                      "rows": [{"n": 1, "square": 1}, {"n": 2, "square": 4}]}
    assert (tmp_path / "squares.md").read_text() == "| 1 | 1 |\n| 2 | 4 |\n"
    run(Squares(numbers=[1, 2, 3]), str(path))  # resumes: only the new arm runs
    assert Squares.ran == [1, 2, 3] and [r["n"] for r in json.loads(path.read_text())["rows"]] == [1, 2, 3]
    before = path.read_text()
    with pytest.raises(StateError, match=r"results file .*squares.json was made with other settings: offset 0 "
                                         r"\(now 1\)"):
        run(Squares(offset=1), str(path))
    assert path.read_text() == before and Squares.ran == [1, 2, 3]


def test_the_runner_keeps_the_rows_a_concurrent_run_of_the_same_settings_wrote(tmp_path):
    path = tmp_path / "squares.json"

    class Concurrent(Squares):
        def run_arm(self, context, arm, row, checkpoint):
            if arm.key == 2:  # meanwhile another run of the same settings wrote its row for 9
                stored = json.loads(path.read_text())
                path.write_text(json.dumps({**stored, "rows": stored["rows"] + [{"n": 9, "square": 81}]}))
            return super().run_arm(context, arm, row, checkpoint)

    result = run(Concurrent(numbers=[1, 2]), str(path))
    assert [row["n"] for row in result["rows"]] == [1, 2, 9] == [row["n"] for row in json.loads(path.read_text())["rows"]]
    assert run(Concurrent(numbers=[1, 2]), str(path)) == result  # nothing left to run: the file as it is


def test_read_results_is_none_without_a_file_and_refuses_one_that_is_not_json(tmp_path):
    assert read_results(str(tmp_path / "none.json"), {}) is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(StateError, match="is not valid JSON"):
        read_results(str(tmp_path / "bad.json"), {})


def test_a_study_without_a_default_results_file_asks_for_one(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(ValueError, match="study 'continual-seeds' has no default results file; give output"):
        studies.get("continual-seeds", inputs=[str(tmp_path / "a.json")]).output_path(None)


def test_study_help_lists_every_study_and_each_study_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["study", "--help"])
    text = capsys.readouterr().out
    assert all(f"{name}: {cls.summary}" in text for name, cls in studies.STUDIES.items())
    for name, cls in studies.STUDIES.items():
        with pytest.raises(SystemExit):
            cli.main(["study", name, "--help"])
        text = capsys.readouterr().out
        assert all(declared.flag in text for declared in cls.options) and "--output" in text


def test_a_bad_study_setting_on_the_command_line_is_one_line_and_status_2(capsys):
    assert cli.main(["study", "robustness", "--ratios", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pyprune study: error: option ratios of study 'robustness' must be in (0, 1]; got 2.0"
