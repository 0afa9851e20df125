"""The `math` built-in reward: the completion's final answer against the reference, compared for
mathematical equivalence by math-verify (HuggingFace's parser and checker, as used by open-r1).

Where the final answer is:

  * in the completion: after the last GSM8K-style `#### ` marker (the rest of that line), or in the
    last `\\boxed{...}` (MATH style), whichever comes later. A completion with neither has no
    answer and scores 0: the prompt is expected to ask for one of the two forms.
  * in the reference: after `####` (GSM8K's `answer` column), in `\\boxed{...}`, or the whole
    string (verl's `reward_model.ground_truth`: a GSM8K number or a MATH answer in bare LaTeX).

How an answer without `\\boxed` is read: math-verify's default parser reads LaTeX only inside
math delimiters (`$...$`, `\\(...\\)`) or as a `\\frac` of two numbers; elsewhere its number
pattern takes the leading number, so `2\\sqrt{2}` would read as 2. A reference is therefore read
as LaTeX first (as if boxed), which also reads plain numbers (`72`, `1,000`); the number reader
is the fallback for what LaTeX cannot parse (`72.`) when there is no LaTeX markup (a backslash).
Text after a completion's `####` is read by the default parser first, since it may go on in words
(`18 dollars`), except when it holds LaTeX markup (`\\`, `^`, `{`) and no `$`: then LaTeX first.

math-verify turns both into SymPy objects and compares them: `\\frac{1}{2}` equals `0.5`,
`1,000` equals `1000`, `\\sqrt{4}` equals `2`. Its parse/verify time limits use SIGALRM, which only
works in a main thread; elsewhere they are off and the reward pool's deadline is the only limit.
"""

from __future__ import annotations

import re
import threading
from typing import Any

GSM8K_MARKER = "####"
LATEX_MARKUP = ("\\", "^", "{")  # in text after a completion's marker: read it as LaTeX first
LEADING_NUMBER = re.compile(r"\$?\s*(-?\d[\d,]*(?:\.\d+)?)(?=\s*$|\s+[A-Za-z(])")
"""A number that opens the marker's line and is followed by words or a parenthesis ("#### 72 (48 +
24)", "#### 18 dollars per week"): the answer, as verl's GSM8K scorer reads the number after "#### "
(the last number of such a line is not; "#### 72 or 73" does not earn 73)."""
BOXED_BARE = re.compile(r"\\boxed\s+([^$\n]+)")
"""`\\boxed 5` (a space, no braces), which verl's MATH scorer reads as 5 (to the next $)."""


def _limit_s() -> int | None:
    """math-verify's own per-call limit (SIGALRM) where it can work: the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _has_value(parsed: list) -> bool:
    """Whether math-verify parsed something; a list of strings only is its unparsed fallback text."""
    return any(not isinstance(item, str) for item in parsed)


def _parse_latex(text: str) -> list:
    from math_verify import LatexExtractionConfig, parse

    return parse(text, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                 parsing_timeout=_limit_s())


def _parse_default(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=_limit_s())


def _parse_bare(text: str, latex_first: bool) -> list:
    """`text` as one answer without `\\boxed`, read as LaTeX (as if boxed) and by math-verify's
    default parser, `latex_first` saying which goes first; the second only when the first parsed
    nothing. The default parser never follows LaTeX that holds a backslash, whose leading number
    it would take (0 of `0.\\overline{3}`)."""
    if latex_first:
        parsed = _parse_latex(f"\\boxed{{{text}}}")
        if _has_value(parsed) or "\\" in text:
            return parsed
        return _parse_default(text) or parsed
    parsed = _parse_default(text)
    return parsed if _has_value(parsed) else _parse_latex(f"\\boxed{{{text}}}") or parsed


def _final_answer(text: str, reference: bool) -> list:
    """Parsed final answer of `text` (empty when it has none). A reference without a marker is
    all answer and is read LaTeX first; a completion without one has no answer."""
    marker, boxed = text.rfind(GSM8K_MARKER), text.rfind("\\boxed")
    if boxed > marker:
        bare = BOXED_BARE.match(text, boxed)
        return _parse_latex(f"\\boxed{{{bare.group(1).strip()}}}" if bare else text[boxed:])
    if marker >= 0:
        rest = text[marker + len(GSM8K_MARKER):].strip()
        if not rest:
            return []
        line = rest.splitlines()[0]
        leading = LEADING_NUMBER.match(line)
        if leading:
            line = leading.group(1)
        latex_first = reference or (any(m in line for m in LATEX_MARKUP) and "$" not in line)
        return _parse_bare(line, latex_first)
    return _parse_bare(text.strip(), latex_first=True) if reference and text.strip() else []


def math_answer(prompt: str, completion: str, answer: str, extra: dict[str, Any] | None = None) -> float:
    """1.0 when the completion's final answer (`#### x` or `\\boxed{x}`) is mathematically equal to
    the reference answer (`#### x`, `\\boxed{x}` or bare), else 0.0; 0.0 when either has none."""
    from math_verify import verify

    predicted = _final_answer(completion, reference=False)
    if not predicted:
        return 0.0
    gold = _final_answer(answer, reference=True)
    return float(bool(gold) and verify(gold, predicted, timeout_seconds=_limit_s()))


def _warm_up() -> None:
    """Import math-verify (and SymPy, ~0.5 s) before the first deadline starts, not inside it."""
    import math_verify  # noqa: F401


math_answer.warm_up = _warm_up  # type: ignore[attr-defined]
