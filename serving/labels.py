"""Reference answers (labels) as the rule scorers read them: text."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any


def label_text(label: Any) -> str:
    """A label as text: a string as it is; a number as a dataset writes it, in plain decimal (JSON's text of a float
    has an exponent from 1e16 and below 1e-4, `1e+20` and `1e-05`, which math-verify reads as other numbers; the
    float's shortest decimal is kept, so `72.0` stays `72.0`); anything else (a list, an object, true, null) as its
    JSON text. ValueError for NaN and infinity, which are no JSON numbers, and RecursionError for nesting past
    Python's recursion limit."""
    if isinstance(label, str):
        return label
    if isinstance(label, float) and not isinstance(label, bool):
        if not math.isfinite(label):
            raise ValueError(f"{label} is not a JSON number")
        return format(Decimal(repr(label)), "f")
    return json.dumps(label, ensure_ascii=False, allow_nan=False)
