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
