"""Every chapter closes with at least three exercises, each with a cell to run and an answer.

The form, as the chapters write it (jupytext py:percent sources, chapters/NN_topic.py):

    # %% [markdown]
    # ## Exercises: predict, then run           <- one level-2 heading that starts with "Exercises"
    #
    # **1. A title.** The question ...         <- numbered 1, 2, 3, ... in order, bold, at the start of a line

    # %%
    ... code that runs the experiment ...       <- at least one code cell after the question

    # %% [markdown]
    # <details><summary>Answer</summary>       <- after that code, before the next question
    #
    # The answer ...                            <- not empty
    # </details>
    #
    # **2. Another title.** ...

Appendix chapters (chapters/A1_...) are optional reading and not held to this.
"""
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
MIN_EXERCISES = 3

HEADING = re.compile(r"^## Exercises\b", re.MULTILINE)
QUESTION = re.compile(r"^\*\*(\d+)\.\s+\S.*?\*\*", re.MULTILINE)
ANSWER = re.compile(r"<details><summary>Answer</summary>(.*?)</details>", re.DOTALL)


def exercise_problems(cells) -> tuple[int, list[str]]:
    """(number of exercises, what is wrong with the section) for a notebook's cells, each a
    (cell_type, source) pair."""
    start = [i for i, (kind, src) in enumerate(cells) if kind == "markdown" and HEADING.search(src)]
    if len(start) != 1:
        return 0, [f"{len(start)} '## Exercises' headings in markdown cells; want exactly one"]
    # The section as a sequence of events in reading order: questions, code cells and answers.
    events = []
    for i, (kind, src) in enumerate(cells[start[0]:]):
        if kind == "code":
            if src.strip():
                events.append(("code", None))
            continue
        if kind != "markdown":
            continue
        if i == 0:
            src = src[HEADING.search(src).start():]
        found = [(m.start(), "question", int(m.group(1))) for m in QUESTION.finditer(src)]
        found += [(m.start(), "answer", m.group(1).strip()) for m in ANSWER.finditer(src)]
        events += [(what, value) for _, what, value in sorted(found)]
        opened, closed = src.count("<details><summary>Answer</summary>"), len(ANSWER.findall(src))
        if opened != closed:
            events.append(("broken answer", None))

    problems, exercises = [], []  # exercises: [number, seen code, seen answer]
    for what, value in events:
        if what == "question":
            exercises.append([value, False, False])
        elif not exercises:
            continue  # text or code before the first question (an introduction) is fine
        elif what == "code":
            exercises[-1][1] = True
        elif what == "broken answer":
            problems.append(f"exercise {exercises[-1][0]}: an Answer block without its closing </details>")
        elif not exercises[-1][1]:
            problems.append(f"exercise {exercises[-1][0]}: the answer comes before any code cell to run")
        elif exercises[-1][2]:
            problems.append(f"exercise {exercises[-1][0]}: more than one answer")
        elif not value:
            problems.append(f"exercise {exercises[-1][0]}: the answer is empty")
        else:
            exercises[-1][2] = True
    numbers = [n for n, _, _ in exercises]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"exercises are numbered {numbers}; want 1, 2, 3, ... in order")
    problems += [f"exercise {n}: no code cell after the question" for n, code, _ in exercises if not code]
    problems += [f"exercise {n}: no answer (<details><summary>Answer</summary> ... </details>) after its code"
                 for n, code, answer in exercises if code and not answer]
    if len(exercises) < MIN_EXERCISES:
        problems.append(f"{len(exercises)} exercises; want at least {MIN_EXERCISES}")
    return len(exercises), problems


def cells_of(path: Path):
    return [(c.cell_type, c.source) for c in jupytext.read(path, fmt="py:percent").cells]


def test_every_chapter_is_checked():
    assert len(CHAPTERS) >= 11, [p.name for p in CHAPTERS]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_exercises_with_answers(path):
    count, problems = exercise_problems(cells_of(path))
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)
    assert count >= MIN_EXERCISES


# --- the check itself, on small made-up sections ------------------------------------------------

def md(*lines):
    return ("markdown", "\n".join(lines))


def code(src="print(1)"):
    return ("code", src)


def answer(text="Because."):
    return md("<details><summary>Answer</summary>", "", text, "</details>")


def well_formed(n):
    cells = [md("# A chapter"), code("x = 1"), md("## Exercises: predict, then run", "", "Predict first.")]
    for i in range(1, n + 1):
        cells += [md(f"**{i}. Question {i}.** What happens?"), code(), answer()]
    return cells


def test_a_well_formed_section_passes():
    assert exercise_problems(well_formed(3)) == (3, [])
    assert exercise_problems(well_formed(4)) == (4, [])


def test_the_chapters_layout_passes():
    # As the chapters write it: an answer, then the next question, in one markdown cell.
    cells = [md("## Exercises: predict, then run", "", "**1. One.** Why?"), code(),
             md("<details><summary>Answer</summary>", "", "This.", "</details>", "", "**2. Two.** How?"), code(),
             md("<details><summary>Answer</summary>", "", "So.", "</details>", "", "**3. Three.** When?"), code(),
             md("<details><summary>Answer</summary>", "", "Now.", "</details>", "", "**Lab.** Lab 01 ...")]
    assert exercise_problems(cells) == (3, [])


def test_too_few_exercises_fail():
    count, problems = exercise_problems(well_formed(2))
    assert count == 2 and any("want at least 3" in p for p in problems)


def test_no_section_fails():
    assert exercise_problems([md("# A chapter"), code()])[1] == [
        "0 '## Exercises' headings in markdown cells; want exactly one"]


def test_a_missing_answer_fails():
    cells = well_formed(3)
    del cells[-1]
    assert exercise_problems(cells)[1] == [
        "exercise 3: no answer (<details><summary>Answer</summary> ... </details>) after its code"]


def test_an_empty_or_unclosed_answer_fails():
    cells = well_formed(3)
    cells[-1] = answer("")
    assert exercise_problems(cells)[1] == ["exercise 3: the answer is empty",
                                           "exercise 3: no answer (<details><summary>Answer</summary> ... "
                                           "</details>) after its code"]
    cells[-1] = md("<details><summary>Answer</summary>", "", "Because.")
    assert "exercise 3: an Answer block without its closing </details>" in exercise_problems(cells)[1]


def test_a_question_without_code_fails():
    cells = well_formed(3)
    del cells[-2]
    assert "exercise 3: the answer comes before any code cell to run" in exercise_problems(cells)[1]


def test_an_answer_before_the_code_fails():
    cells = well_formed(3)
    cells[-2], cells[-1] = cells[-1], cells[-2]
    assert "exercise 3: the answer comes before any code cell to run" in exercise_problems(cells)[1]


def test_numbering_must_run_in_order():
    cells = well_formed(3)
    cells[-3] = md("**4. Question.** What happens?")
    assert "exercises are numbered [1, 2, 4]; want 1, 2, 3, ... in order" in exercise_problems(cells)[1]


def test_answers_before_the_section_do_not_count():
    # A details block earlier in the chapter is no exercise's answer.
    cells = [md("<details><summary>Answer</summary>", "", "Early.", "</details>")] + well_formed(3)
    assert exercise_problems(cells) == (3, [])
