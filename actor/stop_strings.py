"""Stop strings: a row of a generation batch stops once its decoded response contains one of them, also when the
string spans several tokens. The check decodes a short window of each running row's newest tokens, never the whole
sequence, so its cost per decode step does not grow with the response."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

# tokens decoded beyond the longest stop string's UTF-8 byte count: room for a leading token that decodes to a
# fragment of a character, so a string is still seen whole in the window
_SPARE_TOKENS = 2


class StopStringMatcher:
    """Finds the rows whose newest token completes a stop string.

    The window is the longest stop string's length in UTF-8 bytes plus a few tokens: a string of L bytes that ends
    in the newest token starts at most L - 1 tokens before it, since every token carries at least one byte (a
    byte-level BPE splits a character such as an emoji into up to 4 tokens, so counting characters is not enough).
    A string already present one token earlier would have stopped the row then, so a match in the window is a
    match completed by the newest token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: tuple[str, ...]):
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}")
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(len(s.encode()) for s in strings) + _SPARE_TOKENS

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

