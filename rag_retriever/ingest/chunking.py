"""Documents -> title-prefixed, overlapping paragraph chunks with exact character offsets.

Example:
    >>> words = lambda texts: [len(t.split()) for t in texts]
    >>> config = ChunkingConfig(chunk_tokens=8, overlap_tokens=3, max_seq_length=64)
    >>> chunker = Chunker(words, config)
    >>> doc = Document(id="d", title="T", text="One two three. Four five six.\\n\\nSeven eight.")
    >>> [c.text.strip() for c in chunker.chunk(doc)]
    ['One two three. Four five six.', 'Four five six.\\n\\nSeven eight.']

How: the text is cut into paragraphs (blank-line separated) and paragraphs into sentences.
Sentences are packed into a chunk up to a token budget, counted with the embedder's own
tokenizer; a chunk prefers to end where a paragraph ends, so a paragraph that fits the budget is
never split. A sentence longer than the budget is cut at word boundaries. The next chunk starts
one or two sentences back (`overlap_tokens`), so a passage that straddles a cut is whole in one of
the two chunks. The budget leaves room for the title, the model's passage prefix and its special
tokens, so nothing is truncated at embedding time.

Offsets are computed here, not taken from a text splitter: `doc.text[c.start:c.end] == c.text`.
Chunks tile the document: every character, whitespace included, lies in some chunk.
langchain-text-splitters is not used: choosing the split points with its recursive splitter (the
tokenizer as length function) made chunking 4-5x slower and ended far fewer chunks at a sentence
end (SciFact 46% vs 99.9%), and failed chunking tests (docs/design-decisions.md, "Chunking
without langchain-text-splitters").

Not handled: layout (tables, code blocks are treated as text), languages whose sentences do not
end in . ! ? or their full-width forms.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rag_retriever.records import (
    Chunk,
    Document,
    chunk_point_id,
    content_hash,
    embed_text,
    section_at,
    tenant_of,
)

log = logging.getLogger(__name__)

TokenCounter = Callable[[Sequence[str]], list[int]]

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
# A sentence ends at . ! ?, optionally followed by closing quotes or brackets, then whitespace,
# then something that can start a sentence; or at a full-width 。！？ (and its closers), where
# the next sentence follows with or without a space (Chinese and Japanese put none).
_SENTENCE_END = re.compile(
    r"[.!?][\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9À-Ý])|[。！？]+[\"'”’)\]」』）]*\s*(?=\S)"
)
# Dotted abbreviations ("U.S.", "e.g."): letters only, so that "3.5." ends a sentence.
_DOTTED = re.compile(r"([^\W\d]\.)+[^\W\d]?")
# Words before a period that do not end a sentence.
_ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "st",
        "jr",
        "sr",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "fig",
        "al",
        "approx",
        "inc",
        "ltd",
        "co",
        "corp",
        "gen",
        "col",
        "lt",
        "sgt",
        "mt",
        "ft",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)


@dataclass(frozen=True)
class ChunkingConfig:
    # Budget for the chunk body; 200 keeps a typical paragraph whole (see Settings.chunk_tokens).
    chunk_tokens: int = 200
    # One or two sentences of overlap, at most this many tokens.
    overlap_tokens: int = 48
    # The model window (special tokens included), e.g. 256 for all-MiniLM-L6-v2.
    max_seq_length: int = 256
    special_tokens: int = 2
    # Tokens of the model's passage prefix ("passage: " for E5, nothing for MiniLM).
    prefix_tokens: int = 0
    # Longer titles are cut, so that a chunk always has room for its body; None = the smaller
    # of 48 tokens and a quarter of the window.
    max_title_tokens: int | None = None
    # Prefix each chunk of a document with headings (markdown, HTML) with its heading path,
    # `Title > Section > Subsection`, instead of the title alone; the whole path is cut to the
    # title's limit of tokens.
    heading_path: bool = True

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(
                f"overlap_tokens must be in [0, chunk_tokens), got {self.overlap_tokens}"
            )
        if self.room - self.title_limit - 1 < 16:
            raise ValueError(
                f"the model window ({self.max_seq_length} tokens) leaves no room for chunk "
                f"bodies after the prefix and a {self.title_limit}-token title"
            )

    @property
    def room(self) -> int:
        """Tokens left for title + body once the prefix and special tokens are in."""
        return self.max_seq_length - self.special_tokens - self.prefix_tokens

    @property
    def title_limit(self) -> int:
        if self.max_title_tokens is not None:
            return self.max_title_tokens
        return min(48, self.room // 4)


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int
    tokens: int
    paragraph: int


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each paragraph, without the surrounding whitespace."""
    spans = []
    pos = 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        spans.append((pos, match.start()))
        pos = match.end()
    spans.append((pos, len(text)))
    return [_strip(text, s, e) for s, e in spans if text[s:e].strip()]


def sentence_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) of each sentence of text[start:end], trimmed."""
    spans = []
    pos = start
    for match in _SENTENCE_END.finditer(text, start, end):
        cut = match.start() + 1
        # only a period can follow an abbreviation ("Jan? She" ends a sentence)
        if text[match.start()] == "." and _is_abbreviation(_last_word(text, pos, cut)):
            continue
        spans.append((pos, match.end()))
        pos = match.end()
    spans.append((pos, end))
    return [_strip(text, s, e) for s, e in spans if text[s:e].strip()]


def _last_word(text: str, start: int, cut: int) -> str:
    """The last run of non-whitespace of text[start:cut], which ends in a non-space character
    (what `re.search(r"(\\S+)$", text[start:cut])` finds, without copying the sentence and
    scanning it from the left: that was half of the sentence splitting's time)."""
    i = cut - 1
    while i > start and not text[i - 1].isspace():
        i -= 1
    return text[i:cut]


def _is_abbreviation(word_with_period: str) -> bool:
    word = word_with_period.rstrip(".!?\"'”’)]").lower()
    # Initials and dotted abbreviations: "J.", "U.S."
    if len(word) == 1 or _DOTTED.fullmatch(word):
        return True
    return word in _ABBREVIATIONS


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


class Chunker:
    """Cuts documents into chunks; `count_tokens` is the embedder's tokenizer (no specials)."""

    def __init__(self, count_tokens: TokenCounter, config: ChunkingConfig | None = None) -> None:
        self.count_tokens = count_tokens
        self.config = config or ChunkingConfig()

    def chunk(self, doc: Document) -> list[Chunk]:
        cfg = self.config
        title = self._fit_title(doc.title)
        title_tokens = self.count_tokens([title])[0] if title else 0
        room = cfg.room
        budget = self._budget(doc, title_tokens)
        for _ in range(8):
            chunks = self._chunk_with_budget(doc, title, budget)
            worst = max(self._embedded_tokens(chunks), default=0)
            if worst <= room:
                return chunks
            # Token counts were not additive for this tokenizer; shrink and try again.
            budget -= worst - room
        raise ValueError(f"cannot fit the chunks of {doc.id!r} into {cfg.max_seq_length} tokens")

    def chunk_all(self, docs: Sequence[Document]) -> list[Chunk]:
        return [c for doc in docs for c in self.chunk(doc)]

    def chunk_many(self, docs: Sequence[Document]) -> list[list[Chunk]]:
        """`[self.chunk(doc) for doc in docs]`, with the token counting batched across the
        documents: three tokenizer calls for all titles, sentences and chunks instead of
        three or more per document. A fast tokenizer spreads a big batch over the cores, and
        each call has a fixed cost; SciFact chunked ~2x faster on 2 cores. A document whose
        chunks fail the window check is chunked again by `chunk`, as it would have been."""
        cfg = self.config
        raw = iter(self.count_tokens([doc.title for doc in docs if doc.title]))
        titles: list[str] = []
        budgets: list[int] = []
        for doc in docs:
            n = next(raw) if doc.title else 0
            title = doc.title
            if n > cfg.title_limit:  # rare: cut it, as chunk() does, and count it again
                title = self._fit_title(title)
                n = self.count_tokens([title])[0] if title else 0
            titles.append(title)
            budgets.append(self._budget(doc, n))
        spans = [self._spans(doc.text) for doc in docs]
        counts = self.count_tokens(
            [doc.text[s:e] for doc, ss in zip(docs, spans, strict=True) for s, e, _ in ss]
        )
        at = 0
        out: list[list[Chunk]] = []
        for doc, title, budget, doc_spans in zip(docs, titles, budgets, spans, strict=True):
            units = self._units_of(doc.text, doc_spans, counts[at : at + len(doc_spans)], budget)
            at += len(doc_spans)
            out.append(self._pack(doc, title, units, budget))
        embedded = self._embedded_tokens([c for chunks in out for c in chunks])
        at = 0
        for i, chunks in enumerate(out):
            worst = max(embedded[at : at + len(chunks)], default=0)
            at += len(chunks)
            if worst > cfg.room:  # not additive for this tokenizer: the serial path shrinks
                out[i] = self.chunk(docs[i])
        return out

    # -- internals --------------------------------------------------------------------------

    def _budget(self, doc: Document, title_tokens: int) -> int:
        """Tokens for a chunk's body: what the window leaves after the prefix (the title, or for
        a document with headings the heading path, which is cut to the title's limit)."""
        cfg = self.config
        prefix = cfg.title_limit if cfg.heading_path and doc.headings else title_tokens
        # +1 is a margin for tokenizers that give the blank line between title and body a token.
        return min(cfg.chunk_tokens, cfg.room - max(prefix, title_tokens) - 1)

    def _sections(self, doc: Document, title: str, starts: list[int]) -> list[str]:
        """The heading path of each chunk (by where its own text starts), cut so that
        `title > section` fits the title's limit of tokens; "" without headings."""
        if not (self.config.heading_path and doc.headings):
            return ["" for _ in starts]
        paths = [section_at(doc.headings, at) for at in starts]
        fitted = {p: self._fit_section(title, p) for p in set(paths)}
        return [fitted[p] for p in paths]

    def _fit_section(self, title: str, section: str) -> str:
        limit = self.config.title_limit
        words = section.split(" ")
        while words and self.count_tokens([embed_text(title, "", " ".join(words))])[0] > limit:
            words = words[: len(words) * 3 // 4] if len(words) > 1 else []
        return " ".join(words).removesuffix(" >")

    def _fit_title(self, title: str) -> str:
        limit = self.config.title_limit
        if not title or self.count_tokens([title])[0] <= limit:
            return title
        words = title.split()
        while len(words) > 1 and self.count_tokens([" ".join(words)])[0] > limit:
            words = words[: max(1, len(words) * 3 // 4)]
        kept = " ".join(words)
        # one word longer than the limit (a long compound, a code): its head, cut as a word
        # longer than the budget is cut in a body, rather than no title at all
        while kept and self.count_tokens([kept])[0] > limit:
            kept = kept[: len(kept) * 3 // 4]
        return kept

    def _embedded_tokens(self, chunks: list[Chunk]) -> list[int]:
        """Tokens of each chunk's embedded text, body + title + prefix + special tokens."""
        cfg = self.config
        counts = self.count_tokens([c.embed_text for c in chunks])
        return [n + cfg.prefix_tokens + cfg.special_tokens for n in counts]

    def _units(self, text: str, budget: int) -> list[_Unit]:
        spans = self._spans(text)
        return self._units_of(
            text, spans, self.count_tokens([text[s:e] for s, e, _ in spans]), budget
        )

    @staticmethod
    def _spans(text: str) -> list[tuple[int, int, int]]:
        """(start, end, paragraph) of each sentence."""
        spans: list[tuple[int, int, int]] = []
        for p_index, (ps, pe) in enumerate(paragraph_spans(text)):
            spans.extend((s, e, p_index) for s, e in sentence_spans(text, ps, pe))
        return spans

    def _units_of(
        self, text: str, spans: list[tuple[int, int, int]], counts: Sequence[int], budget: int
    ) -> list[_Unit]:
        units: list[_Unit] = []
        for (s, e, p), n in zip(spans, counts, strict=True):
            if n <= budget:
                units.append(_Unit(s, e, n, p))
            else:
                units.extend(self._split_long(text, s, e, p, budget))
        return units

    def _split_long(
        self, text: str, start: int, end: int, paragraph: int, budget: int
    ) -> list[_Unit]:
        """Cut an over-long sentence at word boundaries into pieces within the budget."""
        words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text[start:end])]
        words = [(start + s, start + e) for s, e in words]
        counts = self.count_tokens([text[s:e] for s, e in words])
        pieces: list[_Unit] = []
        piece_start, piece_tokens = words[0][0], 0
        prev_end = words[0][0]
        for (s, e), n in zip(words, counts, strict=True):
            if n > budget:  # one "word" longer than the budget (a URL, a base64 blob): cut it
                if piece_tokens:
                    pieces.append(_Unit(piece_start, prev_end, piece_tokens, paragraph))
                pieces.extend(self._split_word(text, s, e, paragraph, budget))
                piece_start, piece_tokens = e, 0
            elif piece_tokens + n > budget:
                pieces.append(_Unit(piece_start, prev_end, piece_tokens, paragraph))
                piece_start, piece_tokens = s, n
            else:
                if piece_tokens == 0:
                    piece_start = s
                piece_tokens += n
            prev_end = e
        if piece_tokens:
            pieces.append(_Unit(piece_start, prev_end, piece_tokens, paragraph))
        return pieces

    def _split_word(
        self, text: str, start: int, end: int, paragraph: int, budget: int
    ) -> list[_Unit]:
        pieces = []
        pos = start
        while pos < end:
            size = end - pos
            while size > 1 and self.count_tokens([text[pos : pos + size]])[0] > budget:
                size = size * 3 // 4
            n = self.count_tokens([text[pos : pos + size]])[0]
            pieces.append(_Unit(pos, pos + size, n, paragraph))
            pos += size
        return pieces

    def _chunk_with_budget(self, doc: Document, title: str, budget: int) -> list[Chunk]:
        return self._pack(doc, title, self._units(doc.text, budget), budget)

    def _pack(self, doc: Document, title: str, units: list[_Unit], budget: int) -> list[Chunk]:
        text = doc.text
        paragraph_tokens: dict[int, int] = {}
        for u in units:
            paragraph_tokens[u.paragraph] = paragraph_tokens.get(u.paragraph, 0) + u.tokens
        ranges: list[tuple[int, int]] = []
        i, fresh = 0, 0  # chunk starts at unit i; units before `fresh` repeat the last chunk
        n = len(units)
        while i < n:
            j, total = i, 0
            while j < n and total + units[j].tokens <= budget:
                total += units[j].tokens
                j += 1
            if j < n:
                # End where a paragraph ends when one does inside this chunk after new content.
                breaks = [
                    b
                    for b in range(max(i, fresh) + 1, j + 1)
                    if units[b].paragraph != units[b - 1].paragraph
                ]
                if breaks:
                    j = breaks[-1]
            ranges.append((i, j))
            if j >= n:
                break
            overlap = self._overlap(units, i, j, budget, paragraph_tokens)
            i, fresh = j - overlap, j
        chunks = []
        sections = self._sections(doc, title, [units[a].start for a, _ in ranges])
        for index, ((a, b), section) in enumerate(zip(ranges, sections, strict=True)):
            start = 0 if index == 0 else units[a].start
            # Each chunk runs up to where the next unit starts, so the whitespace between
            # chunks belongs to one of them and the chunks tile the document.
            end = units[b].start if b < n else len(text)
            body = text[start:end]
            chunks.append(
                Chunk(
                    id=chunk_point_id(doc.id, index, tenant_of(doc.metadata)),
                    doc_id=doc.id,
                    title=title,
                    chunk_index=index,
                    start=start,
                    end=end,
                    text=body,
                    n_tokens=sum(u.tokens for u in units[a:b]),
                    content_hash=content_hash(embed_text(title, body, section)),
                    metadata=doc.metadata,
                    section=section,
                )
            )
        return chunks

    def _overlap(
        self,
        units: list[_Unit],
        i: int,
        j: int,
        budget: int,
        paragraph_tokens: dict[int, int],
    ) -> int:
        """How many trailing units of chunk [i, j) the next chunk repeats (0, 1 or 2)."""
        limit = self.config.overlap_tokens
        same_paragraph = units[j].paragraph == units[j - 1].paragraph
        next_para = paragraph_tokens[units[j].paragraph]
        best, total = 0, 0
        for o in (1, 2):
            if j - o <= i:  # the next chunk must start after this one
                break
            total += units[j - o].tokens
            if total > limit:
                break
            best = o
        if best == 0 and same_paragraph and j - 1 > i and units[j - 1].tokens <= budget // 2:
            # Inside a long paragraph always repeat one sentence, even a long one, so that a
            # passage crossing the cut is whole in the next chunk.
            best = 1
        if not same_paragraph and next_para <= budget:
            # The next paragraph fits whole: only overlap as much as still leaves room for it.
            while best and sum(u.tokens for u in units[j - best : j]) + next_para > budget:
                best -= 1
        # The next chunk holds at least the unit after this one: an overlap that left no room
        # for it made a chunk of repeated text alone (a duplicate hit, an embedding wasted).
        while best and sum(u.tokens for u in units[j - best : j]) + units[j].tokens > budget:
            best -= 1
        return best
