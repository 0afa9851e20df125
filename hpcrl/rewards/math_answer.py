"""The `math` built-in reward: the completion's final answer against the reference, compared for
mathematical equivalence by math-verify (HuggingFace's parser and checker, as used by open-r1).

Where the final answer is:

  * in the completion: after the last GSM8K-style `#### ` marker (the rest of that line), or in the
    last `\\boxed{...}` (MATH style), whichever comes later. A completion with neither has no
    answer and scores 0: the prompt is expected to ask for one of the two forms.
  * in the reference: after `####` (GSM8K's `answer` column), in `\\boxed{...}`, or the whole
    string (a bare number or expression, e.g. verl's `reward_model.ground_truth`).

math-verify turns both into SymPy objects and compares them: `\\frac{1}{2}` equals `0.5`,
`1,000` equals `1000`, `\\sqrt{4}` equals `2`. Its parse/verify time limits use SIGALRM, which only
works in a main thread; elsewhere they are off and the reward pool's deadline is the only limit.
"""

from __future__ import annotations

import threading
from typing import Any

GSM8K_MARKER = "####"


def _limit_s() -> int | None:
    """math-verify's own per-call limit (SIGALRM) where it can work: the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, boxed: bool) -> list:
    from math_verify import LatexExtractionConfig, parse

    if boxed:
        return parse(text, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                     parsing_timeout=_limit_s())
    parsed = parse(text, parsing_timeout=_limit_s())
    if not parsed:  # bare LaTeX after '####' (e.g. '\frac{1}{2}') is only read inside math delimiters
        parsed = parse(f"${text}$", parsing_timeout=_limit_s())
    return parsed


def _final_answer(text: str, bare_ok: bool) -> list:
    """Parsed final answer of `text` (empty when it has none); `bare_ok`: no marker means the whole
    text is the answer (references), else it means no answer (completions)."""
    marker, boxed = text.rfind(GSM8K_MARKER), text.rfind("\\boxed")
    if boxed > marker:
        return _parse(text[boxed:], boxed=True)
    if marker >= 0:
        rest = text[marker + len(GSM8K_MARKER):].strip()
        return _parse(rest.splitlines()[0], boxed=False) if rest else []
    return _parse(text.strip(), boxed=False) if bare_ok and text.strip() else []


def math_answer(prompt: str, completion: str, answer: str, extra: dict[str, Any] | None = None) -> float:
    """1.0 when the completion's final answer (`#### x` or `\\boxed{x}`) is mathematically equal to
    the reference answer (`#### x`, `\\boxed{x}` or bare), else 0.0; 0.0 when either has none."""
    from math_verify import verify

    predicted = _final_answer(completion, bare_ok=False)
    if not predicted:
        return 0.0
    gold = _final_answer(answer, bare_ok=True)
    return float(bool(gold) and verify(gold, predicted, timeout_seconds=_limit_s()))


def _warm_up() -> None:
    """Import math-verify (and SymPy, ~0.5 s) before the first deadline starts, not inside it."""
    import math_verify  # noqa: F401


math_answer.warm_up = _warm_up  # type: ignore[attr-defined]
