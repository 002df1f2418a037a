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

An answer's numbers come from its cell: every number in an answer precise enough to go stale (three or more
significant digits, or a decimal point) is in the question, in the code the exercise runs, or listed in
ANSWER_NUMBERS with what prints or derives it, so that a change of workload cannot leave an answer quoting
a number that nothing computes.
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


# --- an answer's numbers ------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
YEAR = re.compile(r"(19|20)\d\d")

# Numbers an answer may state that are neither in its question nor literally in its code, each with where it
# comes from: printed by the exercise's cell (rounded as the answer says it), or derived in the answer's own
# arithmetic from numbers that are. Keyed by (chapter number, exercise number).
ANSWER_NUMBERS = {
    ("01", 5): {"11,600": "printed: a billion tokens a day in tokens/s (11,574)",
                "116": "printed: tokens/s per A100 that 100 A100s need",
                "2,300": "printed: tokens/s per A100 that 5 A100s need (2,315)",
                "13.5": "printed: Llama-7B's fp16 weights in GB",
                "150": "printed: one cached stream's ceiling (151 tok/s)"},
    ("07", 1): {"206": "printed: a contiguous slot of 256 positions, 50 written"},
    ("07", 2): {"3.5": "derived in the answer: (8 - 1) / 2"},
    ("09", 3): {"0.8": "printed: GB of Llama-2-13B's KV cache at 1K",
                "280": "printed: the int4 ceiling"},
    ("10", 2): {"4.5": "printed: the decoder's bits a weight in groups of 64"},
    ("10", 3): {"31.25": "printed: Q4_1's 5 bits a weight over bf16's 16, in %"},
}


def stale_prone(number: str) -> bool:
    digits = number.replace(",", "")
    return not YEAR.fullmatch(digits) and ("." in digits or len(digits.lstrip("0")) >= 3)


def exercise_texts(cells) -> list[tuple[int, str, str]]:
    """(number, question and code, answer) for each exercise of a chapter's section, in order."""
    start = next((i for i, (kind, src) in enumerate(cells) if kind == "markdown" and HEADING.search(src)), None)
    exercises = []  # [number, question and code, answer]
    for kind, src in cells[start or 0:] if start is not None else []:
        if kind == "code":
            if exercises:
                exercises[-1][1] += "\n" + src
            continue
        marks = sorted([(m.start(), m.end(), "question", m) for m in QUESTION.finditer(src)]
                       + [(m.start(), m.end(), "answer", m) for m in ANSWER.finditer(src)], key=lambda x: x[0])
        for i, (begin, end, what, m) in enumerate(marks):
            if what == "question":
                stop = marks[i + 1][0] if i + 1 < len(marks) else len(src)
                exercises.append([int(m.group(1)), src[begin:stop], ""])
            elif exercises:
                exercises[-1][2] += m.group(1)
    return [tuple(e) for e in exercises]


def unsourced_numbers(exercises, listed: dict) -> list[str]:
    """What is wrong with an answer's numbers: one stated but found in neither its question, its code nor
    `listed` (keyed by exercise number), or one listed that its answer no longer states."""
    problems = []
    for number, source, answer in exercises:
        plain = source.replace(",", "")
        stated = {n.rstrip(",") for n in NUMBER.findall(answer)}
        for n in sorted(x for x in stated if stale_prone(x)):
            if n not in source and n.replace(",", "") not in plain and n not in listed.get(number, {}):
                problems.append(f"exercise {number}: the answer states {n}, which neither its question nor its "
                                f"code holds: print it from the cell (or list it in ANSWER_NUMBERS with its source)")
        problems += [f"exercise {number}: ANSWER_NUMBERS lists {n}, which the answer no longer states"
                     for n in listed.get(number, {}) if n not in stated]
    return problems


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_answers_state_numbers_their_cells_compute(path):
    chapter = path.name[:2]
    listed = {n: numbers for (c, n), numbers in ANSWER_NUMBERS.items() if c == chapter}
    problems = unsourced_numbers(exercise_texts(cells_of(path)), listed)
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_every_listed_number_names_a_chapter():
    assert {c for c, _ in ANSWER_NUMBERS} <= {p.name[:2] for p in CHAPTERS}


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


def test_an_answer_number_must_come_from_its_cell():
    cells = [md("## Exercises", "", "**1. Speed.** How fast?"), code("print(f'{2 * 58.1:.0f} tok/s')"),
             md("<details><summary>Answer</summary>", "", "About 116 tokens/s, 2 × 58.1, in chapter 04 (2023).",
                "</details>")]
    texts = exercise_texts(cells)
    assert texts[0][0] == 1 and "58.1" in texts[0][1] and "116" in texts[0][2]
    # 58.1 is in the code, 2, 04 and the year are too coarse to go stale; 116 is computed but not stated anywhere.
    assert unsourced_numbers(texts, {}) == [
        "exercise 1: the answer states 116, which neither its question nor its code holds: print it from the "
        "cell (or list it in ANSWER_NUMBERS with its source)"]
    assert unsourced_numbers(texts, {1: {"116": "printed"}}) == []
    assert unsourced_numbers(texts, {1: {"116": "printed", "9.5": "printed"}}) == [
        "exercise 1: ANSWER_NUMBERS lists 9.5, which the answer no longer states"]


def test_numbers_in_the_question_or_with_commas_count():
    cells = [md("## Exercises", "", "**1. Scale.** With 1,024 tokens?"), code("n = 11574"),
             md("<details><summary>Answer</summary>", "", "1,024 tokens, 11,574 a second.", "</details>")]
    assert unsourced_numbers(exercise_texts(cells), {}) == []
