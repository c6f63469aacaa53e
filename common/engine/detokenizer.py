"""Incremental detokenization (ch05): token ids -> text, a piece at a time.

A token can hold part of a UTF-8 character (an emoji is often 2-4 byte
tokens). Decoding each token alone would print "\ufffd" garbage, so we keep
two offsets, as vLLM and TGI do: text is only released once the tokens
since `prefix_offset` decode to something longer than before that does not
end with the replacement character.

Left out: special-token spacing rules of slow tokenizers.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context we re-decode
        self.read_offset = 0  # tokens before this are already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly complete text (maybe "")."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        rest = self._decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return rest
