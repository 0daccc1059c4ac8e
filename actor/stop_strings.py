"""Stop strings: a row of a generation batch stops once its decoded response contains one of them, also when the
string spans several tokens. The check decodes a short window of each running row's newest tokens, never the whole
sequence, so its cost per decode step does not grow with the response."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

# tokens decoded beyond the longest stop string's character count: room for tokens that decode to nothing or to a
# fragment of a character (byte-level pieces), so a string is still seen whole in the window
_SPARE_TOKENS = 2


class StopStringMatcher:
    """Finds the rows whose newest token completes a stop string.

    The window is the longest stop string's length in characters plus a few tokens: a string of L characters that
    ends in the newest token starts at most L - 1 tokens before it when every token decodes to at least one
    character. A string already present one token earlier would have stopped the row then, so a match in the
    window is a match completed by the newest token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: tuple[str, ...]):
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}")
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(len(s) for s in strings) + _SPARE_TOKENS

    def completed(self, sampled: torch.Tensor, t: int, finished: torch.Tensor) -> torch.Tensor:
        """bool [N] on `sampled`'s device: rows not yet `finished` (bool [N]) whose response tokens
        `sampled[:, :t + 1]` (int64 [N, >t], the response so far by batch slot) now contain a stop string."""
        lo = max(0, t + 1 - self.window)
        running = (~finished).nonzero().squeeze(1).tolist()
        hit = torch.zeros(sampled.shape[0], dtype=torch.bool)
        if running:
            tails = sampled[running, lo:t + 1].tolist()
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for row, text in zip(running, texts, strict=True):
                hit[row] = any(s in text for s in self.strings)
        return hit.to(sampled.device)

