"""Chunking: offsets, tiling, budgets, overlap, paragraph integrity; SQuAD gold-span coverage."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_retriever.ingest.chunking import Chunker, ChunkingConfig, paragraph_spans, sentence_spans
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.writer import chunking_config_for
from rag_retriever.records import Document, embed_text
from tests.conftest import shared_data


def words(texts: Sequence[str]) -> list[int]:
    """A tokenizer whose counts add up across whitespace joins, like WordPiece's."""
    return [len(t.split()) for t in texts]


def chars(texts: Sequence[str]) -> list[int]:
    """A tokenizer that is NOT additive (4 characters a token, rounded up)."""
    return [-(-len(t) // 4) for t in texts]


CFG = ChunkingConfig(
    chunk_tokens=24, overlap_tokens=8, max_seq_length=40, special_tokens=2, max_title_tokens=6
)

word = st.sampled_from(["alpha", "Bravo", "c", "délta", "E.g.", "U.S.", "x1", "naïve", "日本"])
sentence = (
    st.lists(word, min_size=1, max_size=14)
    .map(lambda ws: " ".join(ws))
    .flatmap(lambda s: st.sampled_from([".", "!", "?", "", '."']).map(lambda p: s + p))
)
paragraph = st.lists(sentence, min_size=1, max_size=8).map(" ".join)
separator = st.sampled_from(["\n\n", "\n \n", "\n\n\n", "\r\n\r\n"])
document_text = st.tuples(
    st.sampled_from(["", "  ", "\n"]), st.lists(paragraph, min_size=1, max_size=6), separator
).map(lambda t: t[0] + t[2].join(t[1]))


def chunks_of(text: str, counter=words, title: str = "Title", cfg: ChunkingConfig = CFG):
    return Chunker(counter, cfg).chunk(Document(id="doc", title=title, text=text))


@settings(max_examples=150, deadline=None)
@given(document_text, st.sampled_from([words, chars]))
def test_chunks_tile_the_document_and_offsets_round_trip(text: str, counter) -> None:
    chunks = chunks_of(text, counter)
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for c in chunks:
        assert text[c.start : c.end] == c.text
    for a, b in itertools.pairwise(chunks):
        assert b.start <= a.end, "a gap between chunks"
        assert b.start > a.start, "no progress"
        assert b.end > a.end, "a chunk of repeated text alone"
    covered: set[int] = set()
    for c in chunks:
        covered.update(range(c.start, c.end))
    assert covered == set(range(len(text)))
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))


@settings(max_examples=100, deadline=None)
@given(document_text, st.sampled_from([words, chars]))
def test_embedded_text_fits_the_model_window(text: str, counter) -> None:
    for c in chunks_of(text, counter):
        assert counter([c.embed_text])[0] + CFG.special_tokens <= CFG.max_seq_length


@settings(max_examples=50, deadline=None)
@given(document_text)
def test_chunking_is_deterministic(text: str) -> None:
    assert chunks_of(text) == chunks_of(text)


@settings(max_examples=100, deadline=None)
@given(document_text)
def test_a_paragraph_that_fits_is_never_split(text: str) -> None:
    chunks = chunks_of(text)
    budget = CFG.chunk_tokens
    for start, end in paragraph_spans(text):
        if words([text[start:end]])[0] <= budget:
            assert any(c.start <= start and end <= c.end for c in chunks), text[start:end]


def test_overlap_between_chunks_of_one_long_paragraph() -> None:
    sentences = [f"Sentence number {i} says five words." for i in range(30)]
    text = " ".join(sentences)  # one paragraph, 180 "tokens" against a budget of 24
    chunks = chunks_of(text)
    assert len(chunks) > 5
    for a, b in itertools.pairwise(chunks):
        shared = text[b.start : a.end].strip()
        assert shared, "consecutive chunks of one paragraph must overlap"
        assert shared.endswith("."), "the overlap is whole sentences"
        assert 1 <= shared.count(".") <= 2


def test_an_overlap_leaves_room_for_new_text() -> None:
    """Sentences of 4, 4, 4, 4, 4, 18 and 4 words in one paragraph, a budget of 20 and an
    overlap of 8: the two sentences repeated before the 18-word one left it no room, and two
    chunks held only text the first one had."""
    lengths = [4, 4, 4, 4, 4, 18, 4]
    text = " ".join("Word " + " ".join(["w"] * (n - 2)) + " end." for n in lengths)
    cfg = ChunkingConfig(chunk_tokens=20, overlap_tokens=8, max_seq_length=40, special_tokens=2)
    chunks = chunks_of(text, title="", cfg=cfg)
    for a, b in itertools.pairwise(chunks):
        assert b.end > a.end, [(c.start, c.end) for c in chunks]
    assert chunks[-1].end == len(text)


def test_sentence_longer_than_budget_is_cut_at_words() -> None:
    text = " ".join(["word"] * 100)
    chunks = chunks_of(text)
    assert all(words([c.text])[0] <= CFG.chunk_tokens for c in chunks)
    assert all(not c.text[:1].isspace() or c.start == 0 for c in chunks)


def test_single_giant_token_is_cut() -> None:
    text = "x" * 500  # one "word" of 125 char-tokens
    chunks = chunks_of(text, chars)
    assert "".join(c.text for c in chunks) == text
    assert all(chars([c.embed_text])[0] + 2 <= CFG.max_seq_length for c in chunks)


def test_long_titles_are_cut_to_leave_room_for_the_body() -> None:
    chunks = chunks_of("Body text here.", title="one two three four five six seven eight nine")
    assert words([chunks[0].title])[0] <= CFG.title_limit
    assert chunks[0].embed_text == embed_text(chunks[0].title, chunks[0].text)


def test_a_title_of_one_word_too_long_keeps_its_head() -> None:
    """(4 characters a token) A one-word title past the title's budget was dropped whole."""
    title = "Supercalifragilisticexpialidocious-Handbook"
    chunks = chunks_of("Body text here.", counter=chars, title=title)
    kept = chunks[0].title
    assert kept and title.startswith(kept) and chars([kept])[0] <= CFG.title_limit


def test_sentence_splitting_respects_abbreviations() -> None:
    text = "Dr. Smith met J. R. Tolkien in the U.S. Army. Then they left! Did they? Yes."
    spans = [text[s:e] for s, e in sentence_spans(text, 0, len(text))]
    assert spans == [
        "Dr. Smith met J. R. Tolkien in the U.S. Army.",
        "Then they left!",
        "Did they?",
        "Yes.",
    ]


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        # full-width ends need no space after them (the docstring promised them; the pattern
        # wanted a space and a Latin capital, so a Chinese paragraph was one sentence)
        ("今天天气很好。我们去公园吧！你呢？", ["今天天气很好。", "我们去公园吧！", "你呢？"]),
        ("本当？！すごい。待って。。。彼は", ["本当？！", "すごい。", "待って。。。", "彼は"]),
        # a number before the period, and ! or ? after a word that abbreviates, end sentences
        ("The dose was 3.5. Then it rose.", ["The dose was 3.5.", "Then it rose."]),
        ("Is it Jan? She said no.", ["Is it Jan?", "She said no."]),
        ("It was Jan. 5 when we met.", ["It was Jan. 5 when we met."]),
    ],
)
def test_sentence_ends_beyond_latin_periods(text: str, sentences: list[str]) -> None:
    assert [text[s:e] for s, e in sentence_spans(text, 0, len(text))] == sentences


def test_chunk_ids_are_stable_and_records_carry_provenance() -> None:
    doc = Document(id="d1", title="T", text="One. Two.\n\nThree.", metadata={"lang": "en"})
    (c,) = Chunker(words, CFG).chunk(doc)
    assert c.id == Chunker(words, CFG).chunk(doc)[0].id
    assert (c.doc_id, c.chunk_index, dict(c.metadata)) == ("d1", 0, {"lang": "en"})
    assert len(c.content_hash) == 64


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="overlap_tokens"):
        ChunkingConfig(chunk_tokens=10, overlap_tokens=10)
    with pytest.raises(ValueError, match="no room"):
        ChunkingConfig(max_seq_length=40, max_title_tokens=30)


@pytest.mark.data
def test_every_squad_gold_span_lies_inside_a_chunk_and_fits_the_window() -> None:
    """With the default settings and the real MiniLM tokenizer (tokenizer only: fast)."""
    from transformers import AutoTokenizer

    from rag_retriever.models.profiles import resolve_model

    source = resolve_model("all-MiniLM-L6-v2").source
    tok = AutoTokenizer.from_pretrained(source)

    def count(texts: Sequence[str]) -> list[int]:
        ids = tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    class _Enc:
        max_seq_length = 256
        special_tokens = 2
        count_tokens = staticmethod(count)

        class fingerprint:
            passage_prefix = ""

    corpus = load_documents(shared_data("squad_v11_dev", "docs.jsonl"))
    chunks = Chunker(count, chunking_config_for(_Enc(), 200, 48)).chunk_all(corpus.documents)  # type: ignore[arg-type]
    by_doc = defaultdict(list)
    for c in chunks:
        by_doc[c.doc_id].append(c)
    total = inside = 0
    for name in ("questions_train.jsonl", "questions_dev.jsonl"):
        with shared_data("squad_v11_dev", name).open(encoding="utf-8") as fh:
            for line in fh:
                for span in json.loads(line)["gold_spans"]:
                    total += 1
                    inside += any(
                        c.start <= span["start"] and span["end"] <= c.end
                        for c in by_doc[span["doc_id"]]
                    )
    assert total > 10_000
    assert inside / total == 1.0
    lengths = count([c.embed_text for c in chunks])
    assert max(lengths) + 2 <= 256
