"""The `math` built-in reward (math-verify) and the reward signature with `extra`."""

import pytest

from hpcrl.rewards import BUILTIN_REWARDS, load_reward_fn

math_reward = BUILTIN_REWARDS["math"]

GSM8K_REFERENCE = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Altogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72")


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),            # LaTeX fraction vs decimal
    ("half of it: #### 0.5", "\\boxed{\\frac{1}{2}}", 1.0),             # marker vs boxed reference
    ("#### \\frac{1}{2}", "#### 0.5", 1.0),                             # bare LaTeX after the marker
    ("she made 1,000 in all\n#### 1,000", "1000", 1.0),                 # thousands separator
    ("48+24 = 72\n#### 72", GSM8K_REFERENCE, 1.0),                      # GSM8K reference column
    ("#### 72 clips\nsome trailing text", GSM8K_REFERENCE, 1.0),        # rest of the marker's line only
    ("#### 71", GSM8K_REFERENCE, 0.0),                                  # wrong answer
    ("\\boxed{3}", "4", 0.0),                                           # wrong answer, boxed
    ("#### 5 then I changed my mind \\boxed{6}", "6", 1.0),             # the later marker wins
    ("\\boxed{6} ... #### 5", "6", 0.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),                                   # symbolic equivalence
    ("the answer is 72", "72", 0.0),                                    # no marker: no answer
    ("####", "72", 0.0),                                                # empty marker
    ("", "72", 0.0),
    ("#### banana", "72", 0.0),                                         # unparsable answer
    ("#### 72", "", 0.0),                                               # no reference
])
def test_math_reward_hand_checked_cases(completion, answer, expected):
    assert math_reward("prompt", completion, answer) == expected
    assert load_reward_fn("math")("prompt", completion, answer, {}) == expected



# verl's MATH ground truths are bare LaTeX. Each reference of the issue is checked both ways: the full
# answer scores 1, the leading number alone (what a number-only reading of the reference sees) scores 0.
@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),                          # 2 sqrt(2) = sqrt(8)
    ("\\boxed{2}", "2\\sqrt{2}", 0.0),
    ("\\boxed{3\\pi}", "3\\pi", 1.0),
    ("\\boxed{3}", "3\\pi", 0.0),
    ("\\boxed{2^{10}}", "2^{10}", 1.0),
    ("\\boxed{1024}", "2^{10}", 1.0),                                   # 2^10 = 1024
    ("\\boxed{2}", "2^{10}", 0.0),
    ("\\boxed{10}", "2^{10}", 0.0),
    ("\\boxed{10\\sqrt{5}}", "10\\sqrt{5}", 1.0),
    ("\\boxed{10}", "10\\sqrt{5}", 0.0),
    ("\\boxed{1.5\\%}", "1.5\\%", 1.0),
    ("\\boxed{0.015}", "1.5\\%", 1.0),                                  # 1.5% = 0.015
    # math-verify 0.9.0 reads a non-integer percent as its value (1.5% = 0.015, not 1.5); an integer
    # percent also equals its bare number (next table: 10\% and 10)
    ("\\boxed{1.5}", "1.5\\%", 0.0),
    # the same references after a GSM8K marker in the completion
    ("#### 2\\sqrt{2}", "2\\sqrt{2}", 1.0),
    ("#### 2", "2\\sqrt{2}", 0.0),
    ("#### 2^{10}", "2^{10}", 1.0),
    ("#### 2\\sqrt{2}", "2", 0.0),                                      # the LaTeX answer is not its 2
    ("#### 3\\pi", "3", 0.0),
])
def test_math_reward_bare_latex_reference(completion, answer, expected):
    assert math_reward("prompt", completion, answer) == expected


# Further verl-MATH-style references (bare LaTeX) and GSM8K-style plain numbers.
@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\dfrac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{-\\frac{1}{3}}", "-\\frac{1}{3}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "-\\frac{1}{3}", 0.0),                    # the sign counts
    ("\\boxed{-5}", "-5", 1.0),
    ("\\boxed{5}", "-5", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", 1.0),
    ("\\boxed{10\\%}", "10\\%", 1.0),
    ("\\boxed{10}", "10\\%", 1.0),                                      # integer percent: see above
    ("\\boxed{0.1}", "10\\%", 1.0),
    ("\\boxed{20}", "10\\%", 0.0),
    ("\\boxed{90}", "90^\\circ", 1.0),
    ("\\boxed{(1,2)}", "(1,2)", 1.0),                                   # open interval / pair
    ("\\boxed{1}", "(1,2)", 0.0),
    ("\\boxed{[2,5)}", "[2,5)", 1.0),
    ("\\boxed{[2,5]}", "[2,5)", 0.0),
    ("\\boxed{(-\\infty,3]}", "(-\\infty, 3]", 1.0),
    ("\\boxed{3}", "(-\\infty, 3]", 0.0),
    ("\\boxed{5, 3}", "3, 5", 1.0),                                     # several answers, any order
    ("\\boxed{5}", "3, 5", 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{3}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),                       # multiple choice
    ("\\boxed{C}", "\\text{(C)}", 1.0),
    ("\\boxed{B}", "\\text{(C)}", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\boxed{\\text{Tuesday}}", "\\text{Monday}", 0.0),
    ("\\boxed{x^2+1}", "x^2+1", 1.0),
    ("\\boxed{x^2}", "x^2+1", 0.0),
    ("\\boxed{2x+3}", "y = 2x+3", 1.0),                                 # math-verify compares the rhs
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
    ("\\boxed{18}", "\\$18", 1.0),
    # math-verify cannot parse a repeating decimal: only the same text matches, never its leading 0
    ("\\boxed{0.\\overline{3}}", "0.\\overline{3}", 1.0),
    ("\\boxed{0}", "0.\\overline{3}", 0.0),
    ("#### \\dfrac{3}{4}", "0.75", 1.0),
    # GSM8K-style plain numbers, as verl's ground_truth or after '####'
    ("#### 72", "72", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("#### 1,000,000", "#### 1000000", 1.0),
    ("#### 100", "1,000", 0.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### 2.5", "2.5", 1.0),
    ("#### 18 dollars", "18", 1.0),                                     # words after the number
    ("#### $18", "18", 1.0),
    ("#### 72.", "72", 1.0),
    ("#### 72", "72.", 1.0),
    # the number that opens the marker's line, as verl reads it (the last number scored 0, or hedged)
    ("#### 72 (48 + 24)", "72", 1.0),
    ("#### 18 dollars per week for 4 weeks", "18", 1.0),
    ("#### 5 apples, 3 left", "5", 1.0),
    ("#### 72 or 73", "73", 0.0),
    ("#### 1,000 in total", "1000", 1.0),
    ("#### 1/2", "0.5", 1.0),                                           # a fraction is not its leading 1
    ("so the answer is \\boxed 5", "5", 1.0),                          # verl's brace-less \\boxed
    ("so the answer is \\boxed 5$.", "5", 1.0),
])
def test_math_reward_verl_math_and_gsm8k_references(completion, answer, expected):
    assert math_reward("prompt", completion, answer) == expected

def three_args(prompt, completion, answer):
    return float(completion == answer)


def with_extra(prompt, completion, answer, extra=None):
    return float(completion == (extra or {}).get("expected", answer))


def test_reward_signature_with_and_without_extra():
    old = load_reward_fn(f"{__name__}:three_args")
    assert old("p", "x", "x") == 1.0 and old("p", "x", "x", {"k": 1}) == 1.0
    new = load_reward_fn(f"{__name__}:with_extra")
    assert new is with_extra
    assert new("p", "y", "x", {"expected": "y"}) == 1.0 and new("p", "y", "x") == 0.0
    assert BUILTIN_REWARDS["token_match"]("p", "ab", "ab", {}) == 1.0
