"""Special-token text in the texts clients send: runs of pad and EOS text around OpenRLHF's decoded queries, and the
end-of-text marks a response decoded with its special tokens kept ends with.

Every function reads only the end it works on, once, with possessive patterns that never go back into what they
took (a trailing run is matched on a reversed copy of the text's tail), so a run of any length costs time in
proportion to it: a plain regular expression of repeated alternatives, anchored at the end, backtracked, and one
query of 40,000 pads held the server's event loop for seconds.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable

# The end-of-text and padding texts of widely used tokenizers, stripped from the end of a rule-scored response
# whatever tokenizer the reward server has (OpenRLHF sends the policy's, which may not be the server's): Llama 2 and
# Mistral, GPT-2 / GPT-NeoX / Qwen base, Qwen chat, Llama 3, Gemma, Phi-3, gpt-oss, BERT.
COMMON_END_MARKS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
                    "<eos>", "<pad>", "<|end|>", "<|return|>", "[SEP]", "[PAD]")


@functools.lru_cache(maxsize=16)
def _one_of(marks: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(m) for m in marks))


@functools.lru_cache(maxsize=16)
def _run(marks: tuple[str, ...]) -> re.Pattern[str]:
    """A run of `marks` with whitespace before each, matched from the start. Possessive (`*+`): a match never goes
    back into what it took, so it costs time in proportion to the run however it ends."""
    return re.compile(r"(?:\s*+(?:" + _one_of(marks).pattern + "))*+")


def leading_run_end(text: str, marks: tuple[str, ...]) -> int:
    """Where the run of `marks` that `text` starts with ends (whitespace between them, and after the last, is part
    of the run; tokenizers that decode with spaces put it there); 0 when text starts with none."""
    end = _run(marks).match(text).end()
    return len(text) - len(text[end:].lstrip()) if end else 0


def trailing_run(text: str, marks: tuple[str, ...], end: int) -> tuple[int, int]:
    """(start, count) of the run of `marks` that `text[:end]` ends with, whitespace between and after them allowed;
    (end, 0) when it ends with none. Only the stretch of the marks' characters and whitespace at the end is read,
    backwards (as a reversed copy, matched from its start)."""
    characters = "".join(set("".join(marks))) + string.whitespace
    tail = text[len(text[:end].rstrip(characters)):end][::-1]
    backwards = tuple(m[::-1] for m in marks)
    run = _run(backwards).match(tail).end()
    if not run:
        return end, 0
    return end - run, len(_one_of(backwards).findall(tail, 0, run))


def without_end_marks(text: str, marks: tuple[str, ...]) -> str:
    """`text` without the run of special-token text it ends with (EOS, pad, end of turn), and the whitespace around
    it: what decoding with skip_special_tokens leaves at the end of a response."""
    start, count = trailing_run(text, marks, len(text))
    return text[:start].rstrip() if count else text


def special_marks(tokens: Iterable[str | None]) -> tuple[str, ...]:
    """The non-empty ones, longest first (so a mark that begins with another is tried before it), without repeats."""
    return tuple(sorted({t for t in tokens if isinstance(t, str) and t}, key=lambda t: (-len(t), t)))
