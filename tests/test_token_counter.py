"""Token counting by pieces: the same counts as tokenising each text whole (the oracle), on
adversarial text and on the real corpora; the chunks it gives are the chunks main gave; only the
tokenizers whose additivity is proven take the piece path."""

from __future__ import annotations

import pickle
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_retriever.ingest.chunking import Chunker, ChunkingConfig, sentence_spans
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.models.token_counter import TokenizerCounter, splits_at_whitespace
from rag_retriever.records import Document
from tests.conftest import shared_data
from tests.test_chunking import document_text
from tests.test_parallel_chunking import minilm_counter

# Pieces chosen to break additivity if any of its conditions were wrong: whitespace that Python
# sees but BERT removes (\x0b \x0c \x1c \x85) or keeps inside a word, combining marks after a
# separator, CJK, an added token ([MASK]) and its halves, ASCII and Unicode punctuation, a word
# longer than WordPiece's 100 characters (one [UNK]), control characters and U+FFFD.
_ATOMS = [
    "alpha",
    "Bravo",
    "naïve",
    "NAI\u0308VE",
    "\u0301",
    "日本語",
    "[MASK]",
    "[MAS",
    "K]",
    "[",
    "]",
    "e.g.",
    "U.S.",
    "(x-1)",
    "5%",
    "’s",
    "—",
    "«»",
    "İstanbul",
    "ΣΑΣ",
    "\x00",
    "\ufffd",
    "\u200b",
    "x" * 120,
    "co-operation",
    "https://example.org/a?b=c",
]
_GAPS = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x85",
    "\xa0",
    "\u2028",
    "\u3000",
]
texts = st.lists(st.tuples(st.sampled_from(_ATOMS), st.sampled_from(_GAPS)), max_size=40).map(
    lambda parts: "".join(a + g for a, g in parts)
)
any_text = st.one_of(texts, st.text(max_size=200))


@pytest.fixture(scope="module")
def counter() -> TokenizerCounter:
    counter = minilm_counter()
    assert counter.by_pieces, "all-MiniLM-L6-v2's tokenizer is counted by pieces"
    return counter


@settings(max_examples=400, deadline=None)
@given(batch=st.lists(any_text, max_size=6))
def test_counts_by_pieces_equal_whole_text_counts(counter: TokenizerCounter, batch) -> None:
    assert counter(batch) == counter.count_whole(batch)
    # again, from what was remembered
    assert counter(batch) == counter.count_whole(batch)


@settings(max_examples=100, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=2_000), max_size=4))
def test_any_span_counts_as_the_tokenizer(counter: TokenizerCounter, text: str, cuts) -> None:
    """Spans cut anywhere, also inside a word or an added token, as _split_word cuts them."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    spans = [text[a:b] for a in bounds for b in bounds if a < b]
    assert counter(spans) == counter.count_whole(spans)


def test_the_counter_pickles_without_what_it_remembered(counter: TokenizerCounter) -> None:
    batch = ["Normans gave their name to Normandy.", "naïve [MASK] 日本"]
    counter(batch)
    copy = pickle.loads(pickle.dumps(counter))
    assert copy._known == {"": 0} and copy.by_pieces
    assert copy(batch) == counter.count_whole(batch)


def _bpe_backend(**pre: bool) -> tokenizers.Tokenizer:
    from tokenizers import models, pre_tokenizers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return backend


def test_only_proven_tokenizers_are_counted_by_pieces(counter: TokenizerCounter) -> None:
    assert counter._backend is not None and splits_at_whitespace(counter._backend)
    assert not splits_at_whitespace(_bpe_backend())  # "Hello" and " Hello" differ
    stripping = tokenizers.Tokenizer.from_str(counter._backend.to_str())
    stripping.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True)])
    assert not splits_at_whitespace(stripping)  # an added token that eats a separator
    spaced = tokenizers.Tokenizer.from_str(counter._backend.to_str())
    spaced.add_tokens(["new york"])
    assert not splits_at_whitespace(spaced)
    assert not TokenizerCounter(counter.tokenizer, by_pieces=False).by_pieces


# The sentence splitter as main wrote it: the oracle of the faster last-word lookup.
def _main_sentence_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    from rag_retriever.ingest.chunking import _SENTENCE_END, _is_abbreviation, _strip

    spans = []
    pos = start
    for match in _SENTENCE_END.finditer(text, start, end):
        cut = match.start() + 1
        word = re.search(r"(\S+)$", text[pos:cut])
        if text[match.start()] == "." and word and _is_abbreviation(word.group(1)):
            continue
        spans.append((pos, match.end()))
        pos = match.end()
    spans.append((pos, end))
    return [_strip(text, s, e) for s, e in spans if text[s:e].strip()]


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(document_text, texts, st.text(max_size=300)))
def test_sentence_spans_are_main_s(text: str) -> None:
    assert sentence_spans(text, 0, len(text)) == _main_sentence_spans(text, 0, len(text))


def test_python_regex_whitespace_is_str_isspace() -> None:
    """_last_word tests str.isspace where main's regex used \\s: the same set of characters."""
    spaces = re.compile(r"\s")
    assert all(
        bool(spaces.match(chr(c))) == chr(c).isspace()
        for c in range(0x110000)
        if not 0xD800 <= c < 0xE000
    )


@pytest.mark.data
@pytest.mark.slow
@pytest.mark.parametrize("name", ["scifact", "squad_v11_dev"])
def test_real_corpora_chunk_as_main_did(name: str) -> None:
    """Every document of both corpora: the same chunks (ids, order, offsets, token counts,
    hashes) with counts by pieces as with each text tokenised whole."""
    docs = list(load_documents(shared_data(name, "docs.jsonl")).documents)
    counter = minilm_counter()
    config = ChunkingConfig(chunk_tokens=200, overlap_tokens=48, max_seq_length=256)
    before = Chunker(TokenizerCounter(counter.tokenizer, by_pieces=False), config)
    after = Chunker(counter, config)
    assert after.chunk_many(docs) == before.chunk_many(docs)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.sampled_from(_ATOMS), st.one_of(texts, document_text)), max_size=8)
)
def test_adversarial_documents_chunk_as_main_did(counter: TokenizerCounter, rows) -> None:
    config = ChunkingConfig(
        chunk_tokens=24, overlap_tokens=8, max_seq_length=48, max_title_tokens=8
    )
    docs = [Document(id=f"d{i}", title=t, text=x) for i, (t, x) in enumerate(rows)]
    before = Chunker(TokenizerCounter(counter.tokenizer, by_pieces=False), config)
    assert Chunker(counter, config).chunk_many(docs) == before.chunk_many(docs)
