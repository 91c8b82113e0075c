"""Incremental detokenization and stop strings.

Text is emitted only once the bytes decoded so far form whole characters: a
multi-byte character split across tokens decodes to U+FFFD until its last
byte arrives, so we hold it back until then. Decoding a short window (from
`prefix_offset`) and diffing against the window's previous text keeps each
step O(1) and keeps tokenizers that strip a leading space on the first token
of a decode from eating it.
"""

from __future__ import annotations

# Tokens of prompt context decoded with the first generated tokens, so that
# word-boundary handling sees what precedes them.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> tuple[str, str | None]:
        """Add one token; returns (new text, the stop string matched or None).

        When a stop string matches, `text` is cut at it (or just after it with
        include_stop_str_in_output) and the returned delta respects the cut.
        """
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", None  # an incomplete character: wait for more bytes
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        old_len = len(self.text)
        self.text += delta
        matched = self._find_stop(old_len)
        return self.text[old_len:], matched

    def _find_stop(self, old_len: int) -> str | None:
        """Look for a stop string that ends inside the new delta; truncate text there."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            start = max(0, old_len - len(s) + 1)
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[:idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def decode_token(self, token_id: int) -> str:
        """The text of a single token, for logprob entries."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
