"""Counting tokens the way the embedder's tokenizer does, cheaply and picklably.

Example:
    >>> count = TokenizerCounter(transformers.AutoTokenizer.from_pretrained(path))  # doctest: +SKIP
    >>> count(["Normans gave their name to Normandy."])  # doctest: +SKIP
    [8]

This module imports `tokenizers` only (no torch, no transformers), so a chunking worker process
that unpickles a counter starts in a fraction of a second. It does not truncate or add special
tokens.

Counting by pieces. The chunker counts the same words many times (each sentence, then each
chunk with its title, overlaps twice), and a BERT tokenizer's Rust side spends most of its time
normalising and pre-tokenising, not in WordPiece (SciFact, one core: 1.6 M tokens in ~4-5 s, of
which WordPiece over the 36k distinct words ~0.1 s). For a tokenizer that splits at ASCII
whitespace no matter the context (`splits_at_whitespace`), the count of a text is the sum of
the counts of its pieces between runs of space, tab, newline and carriage return, so each
distinct piece is tokenised once and remembered. Why the sum is exact, stage by stage:

1. added tokens ([MASK], ...) are matched in the raw text; none contains a separator or strips
   or needs a word boundary (checked), so every match lies inside one piece, alone or not;
2. `BertNormalizer` acts character by character (drop control characters, whitespace to a
   space, spaces around CJK, NFD and accent removal, lowercase); the four separators stay
   whitespace, and NFD's reordering of combining marks stops at them (combining class 0);
3. `BertPreTokenizer` splits at every whitespace character, so no word spans a separator;
4. `WordPiece` tokenises each word alone.

A piece seen for the first time is counted as the sum of its parts cut at ASCII punctuation
that no added token contains: BertPreTokenizer makes each such character a word of its own and
BertNormalizer leaves it as it is, so the same four steps apply ("cells." and "cells," are
"cells" and a mark; SciFact: 44k distinct parts instead of 92k distinct pieces).

Any other tokenizer (byte-level BPE, SentencePiece, a slow Python tokenizer) is counted text by
text, as before. Not handled: other normalizers or pre-tokenizers that would also qualify; they
take the text-by-text path until someone proves and tests them.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from typing import Any

import tokenizers

# The characters at which a qualifying tokenizer always splits (see the module docstring).
SEPARATORS = " \t\n\r"
# Distinct pieces remembered per counter before the memory is cleared (~100 MB at worst; a
# SciFact-sized corpus has ~60k distinct pieces).
MAX_CACHED_PIECES = 2**20  # about a million
# Longer pieces (a URL, a base64 blob) are counted every time rather than kept.
MAX_CACHED_PIECE_CHARS = 256


def splits_at_whitespace(backend: tokenizers.Tokenizer) -> bool:
    """Whether the count of a text is the sum of the counts of its pieces between runs of
    ' ', '\\t', '\\n', '\\r' (the module docstring says why, for the configurations accepted)."""
    config = json.loads(backend.to_str())
    normalizer = config.get("normalizer")
    pre_tokenizer = config.get("pre_tokenizer")
    model = config.get("model") or {}
    if normalizer is not None and normalizer.get("type") != "BertNormalizer":
        return False
    if (pre_tokenizer or {}).get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece":
        return False
    for token in config.get("added_tokens") or []:
        content = str(token.get("content", ""))
        if token.get("single_word") or token.get("lstrip") or token.get("rstrip"):
            return False
        if not content or any(c.isspace() for c in content):
            return False
    return True


def _punctuation_splitter(backend: tokenizers.Tokenizer) -> re.Pattern[str]:
    """Finds the runs between isolated punctuation characters, and those characters: ASCII
    punctuation (BertPreTokenizer's definition) that no added token contains."""
    added = "".join(str(t.get("content", "")) for t in json.loads(backend.to_str())["added_tokens"])
    isolated = re.escape("".join(c for c in string.punctuation if c not in added))
    if not isolated:
        return re.compile(r"(?s).+")  # the whole piece
    return re.compile(f"[^{isolated}]+|[{isolated}]")


def _split_pieces(text: str) -> list[str]:
    """The pieces of `text` between the SEPARATORS, with empty strings where separators repeat
    (they count 0); str.split is ~2.5x faster than a regular expression here."""
    if "\t" in text or "\n" in text or "\r" in text:
        text = text.replace("\t", " ").replace("\n", " ").replace("\r", " ")
    return text.split(" ")


class TokenizerCounter:
    """Tokens of each text without special tokens, as `tokenizer(texts, add_special_tokens=False)`
    counts them; picklable, so chunking worker processes can take it (rag_retriever/ingest/parallel_chunking.py).

    With a fast tokenizer it calls its Rust backend directly (a copy without the truncation and
    padding that tokenizer.json may carry), skipping transformers' per-call settings and the
    offsets: the chunker calls it several times per document, and transformers' wrapper cost
    more than the tokenisation (SciFact: 6,007 calls, 6.2 s of 7.4 s of chunking). When the
    tokenizer qualifies (`splits_at_whitespace`), each distinct piece between whitespace is
    tokenised once per counter (module docstring); `by_pieces=False` counts text by text (the
    way main counted before, kept for the benchmark and the tests).
    """

    def __init__(self, tokenizer: Any, *, by_pieces: bool = True) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend: tokenizers.Tokenizer | None = None
        self.by_pieces = False
        if isinstance(backend, tokenizers.Tokenizer):
            self._backend = tokenizers.Tokenizer.from_str(backend.to_str())
            self._backend.no_truncation()
            self._backend.no_padding()
            self.by_pieces = by_pieces and splits_at_whitespace(self._backend)
        self._known: dict[str, int] = {"": 0}
        self._punctuation: re.Pattern[str] | None = None
        if self._backend is not None and self.by_pieces:
            self._punctuation = _punctuation_splitter(self._backend)

    def __call__(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        if self.by_pieces:
            return self._count_by_pieces(texts)
        return self.count_whole(texts)

    def count_whole(self, texts: Sequence[str]) -> list[int]:
        """Each text tokenised as a whole (the oracle of the piece counts in the tests)."""
        if not texts:
            return []
        if self._backend is None:  # a slow (Python) tokenizer
            ids = self.tokenizer(
                list(texts), add_special_tokens=False, truncation=False, verbose=False
            )["input_ids"]
            return [len(x) for x in ids]
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [len(e) for e in encodings]

    def _count_by_pieces(self, texts: Sequence[str]) -> list[int]:
        known = self._known
        if len(known) > MAX_CACHED_PIECES:
            known.clear()
            known[""] = 0
        get = known.__getitem__
        per_text = [_split_pieces(text) for text in texts]
        out: list[int] = []
        pending: list[int] = []  # texts with a piece not seen before
        for i, pieces in enumerate(per_text):
            try:
                out.append(sum(map(get, pieces)))
            except KeyError:
                out.append(-1)
                pending.append(i)
        if pending:
            long = self._learn({p for i in pending for p in per_text[i] if p not in known})
            for i in pending:
                if long:
                    out[i] = sum(known[p] if p in known else long[p] for p in per_text[i])
                else:
                    out[i] = sum(map(get, per_text[i]))
        return out

    def _learn(self, pieces: set[str]) -> dict[str, int]:
        """Count these pieces and remember them, but for the long ones, returned instead. A
        piece is counted as the sum of its parts split at the isolated punctuation (an ASCII
        punctuation character is a word of its own for BertPreTokenizer and is left alone by
        BertNormalizer), skipping those that some added token contains: the parts repeat far
        more than the pieces ("cells", "." and "," instead of "cells.", "cells,")."""
        known = self._known
        assert self._punctuation is not None, "only a counter by pieces learns pieces"
        parts_of = {p: self._punctuation.findall(p) for p in pieces}
        new = list({q for parts in parts_of.values() for q in parts if q not in known})
        counts = dict(zip(new, self.count_whole(new), strict=True))
        long: dict[str, int] = {}
        for piece, parts in parts_of.items():
            n = sum(known[q] if q in known else counts[q] for q in parts)
            (known if len(piece) <= MAX_CACHED_PIECE_CHARS else long)[piece] = n
        for q in new:
            if len(q) <= MAX_CACHED_PIECE_CHARS:
                known[q] = counts[q]
        return long

    def __getstate__(self) -> dict[str, Any]:
        # the backend alone, when there is one: the transformers wrapper and the remembered
        # pieces need not travel
        state = {**self.__dict__, "_known": {"": 0}}
        if self._backend is not None:
            state["tokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
