"""Rule-based scorers: a response text (and optionally a reference answer) -> a float reward.

Each is reported as the component `reward/<name>`. Add a scorer by adding it to SCORERS; its description
goes into the reward server's config reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from embedded.task import negative_fraction, positive_fraction, response_words


@dataclass(frozen=True)
class RuleScorer:
    """`score(response, label)`: `response` is the response alone (prompt removed, special tokens skipped);
    `label` is the sample's reference answer, or None when the request carries no labels. A scorer without `score`
    runs in worker processes the reward server starts (math_verify: reward_server.verifier)."""

    score: Callable[[str, str | None], float] | None
    description: str
    needs_labels: bool = False


def exact_match(response: str, label: str | None) -> float:
    """1.0 if the response equals the reference answer (both stripped of surrounding whitespace), else 0.0."""
    assert label is not None
    return float(response.strip() == label.strip())


def math_answer(response: str, label: str | None) -> float:
    """1.0 if the response's final answer equals the reference answer's, else 0.0 (see `final_answer`; both are
    cleaned of notation that does not change the answer (`clean_answer`); numbers compare by value, a number
    followed by words ("18 dollars") as the number, anything else as text without spaces)."""
    assert label is not None
    got = final_answer(response.translate(_PLAIN), last_number=True)
    want = final_answer(label.translate(_PLAIN), last_number=False)
    if got is None or want is None:
        return 0.0
    got, want = clean_answer(got), clean_answer(want)
    a, b = _value(got), _value(want)
    if a is not None and b is not None:
        return float(a == b)
    return float(_squeeze(got) == _squeeze(want))


# a Unicode minus sign is a minus; zero-width characters, a byte-order mark and soft hyphens are nothing
_PLAIN = str.maketrans({"\u2212": "-", **dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u200e\u200f\u2060\ufeff"))})
_WRAPPER = re.compile(r"\\(?:text|textbf|mathbf|mathrm|textrm|mbox|operatorname)\s*\{([^{}]*)\}")
# possessive: with `\s*\{?\s*` a `^` before a long run of blanks and no \circ was tried at every split of the run
# (quadratic: a 60 KB response held the server, GIL and all, for 2.7 s)
_DEGREES = re.compile(r"\^\s*+\{?\s*+\\circ\s*+\}?|°")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*=\s*(?=\S)")  # x = 7
_BARE_FRAC = re.compile(r"\\([dt]?frac)\s*+(\d)\s*+(\d)")  # \frac12, \frac 12
_HALF_BARE_FRAC = re.compile(r"\\([dt]?frac)\s*+(?:\{([^{}]*+)\}\s*+(\d)|(\d)\s*+\{)")  # \frac{1}2, \frac1{2}
_TEX_SPACE = re.compile(r"\\(?:[,;:> ]|q?quad)|~")  # \, \; \: \> \  \quad \qquad ~
_SUBSCRIPT = re.compile(r"_\{(\w+)\}")  # 1011_{2} (a base) as 1011_2
# 18 dollars (not 2 x); two letters, then letters and spaces: `[A-Za-z]{2,}[A-Za-z ]*` matched the same texts with
# two ways to split every run of letters, which a failed fullmatch tried all of (a 40,000-letter label, 11 s)
_WITH_UNIT = re.compile(r"(-?\$?[\d.,/]+%?)\s+[A-Za-z]{2}[A-Za-z ]*(?:\^\{?\d\}?)?\.?")  # 10 cm, 10 cm^2
_MAX_WRAPPER_DEPTH = 16  # each level is a pass over the answer: unbounded, a label of nested \text{ took 16 s


def clean_answer(text: str) -> str:
    """An answer without notation that leaves it the same answer: TeX's {,} thousands separator,
    \\$, \\left/\\right, degrees (^\\circ, °), TeX spacing (\\, \\; \\  ~ \\quad: a blank), \\text{...}-style wrappers (their
    content kept, after a blank; up to 16 nested), markdown bold, and a leading single-variable assignment (x = 7 -> 7);
    \\frac12, \\frac 12, \\frac{1}2 and \\frac1{2} become \\frac{1}{2}, and a subscript in braces (1011_{2}) loses them."""
    t = text.replace("{,}", ",").replace("\\$", "$")
    t = t.replace("\\left", "").replace("\\right", "")
    t = _DEGREES.sub("", t)
    t = _TEX_SPACE.sub(" ", t)
    for _ in range(_MAX_WRAPPER_DEPTH):  # a blank before the content: 10\text{cm} is 10 cm
        if (unwrapped := _WRAPPER.sub(r" \1", t)) == t:
            break
        t = unwrapped
    t = _ASSIGNMENT.sub("", t.strip().strip("*").strip())
    t = _SUBSCRIPT.sub(r"_\1", t)
    t = _HALF_BARE_FRAC.sub(lambda m: f"\\{m[1]}{{{m[2]}}}{{{m[3]}}}" if m[2] is not None else f"\\{m[1]}{{{m[4]}}}{{", t)
    return _BARE_FRAC.sub(r"\\\1{\2}{\3}", t).strip()


def _value(answer: str) -> Fraction | None:
    """The answer as a number, or the number it starts with when only words follow (a unit: 18 dollars)."""
    number = as_number(answer)
    if number is None and (unit := _WITH_UNIT.fullmatch(answer.strip())):
        number = as_number(unit.group(1))
    return number


def final_answer(text: str, *, last_number: bool) -> str | None:
    """The answer a text ends with: the content of its last \\boxed{...} (or \\fbox{...}), else what follows its
    last '####' (GSM8K's answer line), else with `last_number` its last number (a reference answer without either
    marker is the answer whole). None when there is none."""
    boxed = _last_braced(text, ("\\boxed", "\\fbox"))
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    if last_number:  # TeX's {,} thousands separator first: the last number of "1{,}234" is 1234, not 234
        numbers = _NUMBER.findall(text.replace("{,}", ","))
        return numbers[-1] if numbers else None
    return text.strip() or None


# a number never ends with its thousands separator: "72, which is the answer" is 72
_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?|-?\.\d+")
_EXPONENT = re.compile(r"[eE][-+]?([\d_]+)")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def as_number(text: str) -> Fraction | None:
    """`text` as an exact number: integers, decimals (in e-notation too), a/b, \\frac{a}{b}, with thousands
    separators, a leading $ or a trailing % / . / unit-less TeX spacing dropped; None when it is not one, and for an
    exponent of more than 3 digits, which Fraction would expand digit by digit (a 20-byte `1e20000000` held the
    scorer for seconds; such an answer compares as text)."""
    t = text.strip().strip("$").replace("\\!", "").replace("\\,", "").replace(" ", "")
    t = t.removesuffix("\\%").removesuffix("%").rstrip(".")
    if t.startswith("-$"):  # -\$5
        t = "-" + t[2:]
    if "_" in t:  # 1011_2 is a base, not Fraction's digit separator (1_2 read as 12)
        return None
    frac = _FRAC.match(t)
    if frac:
        sign, numerator, denominator = frac.groups()
        try:
            return (-1 if sign else 1) * Fraction(numerator) / Fraction(denominator)
        except (ValueError, ZeroDivisionError):
            return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    if (exponent := _EXPONENT.search(t)) and len(exponent.group(1).lstrip("0_")) > 3:
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _last_braced(text: str, commands: tuple[str, ...]) -> str | None:
    """The brace-balanced argument of the last of `commands` in `text` (None if absent or unclosed)."""
    starts = [text.rfind(c + "{") + len(c) for c in commands if c + "{" in text]  # where each last one's { is
    if not starts:
        return None
    start = max(starts)
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1: i]
    return None


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$")).removeprefix("\\text{").removesuffix("}")


def no_negative(response: str, label: str | None = None) -> float:
    """1 - negative_fraction(response): 1.0 for a response without negative words, and 0.0 for a response
    without any words, so an empty answer earns nothing."""
    if not response_words(response):
        return 0.0
    return 1.0 - negative_fraction(response)


SCORERS: dict[str, RuleScorer] = {
    "positive_fraction": RuleScorer(
        lambda response, label: positive_fraction(response),
        "the embedded task's ground truth: the fraction of response words that are positive",
    ),
    "no_negative": RuleScorer(
        no_negative,
        "1 - the fraction of response words that are negative, with positive_fraction's word rules; 0.0 for "
        "a response without words",
    ),
    "exact_match": RuleScorer(
        exact_match,
        "1.0 when the response equals the label, both stripped of surrounding whitespace, else 0.0; requests "
        "must carry labels",
        needs_labels=True,
    ),
    "math_answer": RuleScorer(
        math_answer,
        "1.0 when the response's final answer (its last \\boxed{...}, else what follows its last ####, else its last "
        "number) equals the label's (its \\boxed{...} or #### answer, else the whole label), numbers compared by "
        "value (1,000 = 1{,}000 = 1000.0, 0.5 = 1/2 = \\frac{1}{2} = \\frac12 = \\frac 12 = 5e-1, $, %, degrees, "
        "a unit after the number (10 cm, 10\\,\\text{cm}, 10 cm^2) and x = dropped, \\text{...} and markdown bold "
        "unwrapped, zero-width characters ignored; an exponent past 3 digits, and a number with a subscript (a base: "
        "1011_2 = 1011_{2}), compare as text), else 0.0; requests must carry labels",
        needs_labels=True,
    ),
    "math_verify": RuleScorer(
        None,
        "Hugging Face's math-verify as NeMo-RL's math environment calls it: 1.0 when the response's answer (a "
        "plain expression or LaTeX, its \\boxed{...} first; several boxed answers are read together as one set, "
        "as math-verify reads them, so \\boxed{3} then \\boxed{4} matches neither 3 nor 4) is mathematically equal "
        "to the label's (its \\boxed{...} or #### answer, else the whole label), symbolically (\\sqrt{8} = "
        "2\\sqrt{2}, (x+1)^2 = x^2+2x+1, sets, intervals), else 0.0; a response's last 16,384 characters are read "
        "(from its last \\boxed{ where that lies before them); in worker processes with a time limit (math_verify); "
        "requests must carry labels",
        needs_labels=True,
    ),
}


def describe_scorers() -> str:
    """Every scorer with its description, for the config reference and --help."""
    return "; ".join(f"{name} ({scorer.description})" for name, scorer in SCORERS.items())


def component_name(scorer: str) -> str:
    return f"reward/{scorer}"
