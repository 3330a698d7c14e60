"""Answer a question with retrieved chunks and numbered citations: the shape of a RAG chat app.

    python examples/chat_app.py "how do I roll back a bad ingest?" --collection demo
    python examples/chat_app.py "how do I roll back a bad ingest?" --url http://127.0.0.1:8000

In-process by default (loads the models here, reads RAG_DATA_DIR); with --url it asks a running
`rag-retriever serve` instead (RAG_API_KEY is sent if set). `call_llm` is a placeholder: replace
it with your LLM call. This script does not keep chat history or stream tokens.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from rag_retriever.records import MODES, Hit, Mode

INSTRUCTIONS = (
    "Answer the question using only the sources below. Cite every claim with the source "
    "number in brackets, like [1]. If the sources do not contain the answer, say so."
)

# A source line of the prompt, as `citation` writes it.
CITATION = re.compile(r"^\[\d+\] .+ \(.+, chars \d+-\d+\)$")


def citation(number: int, hit: Hit) -> str:
    """`[1] Title (doc_id, chars start-end)`: enough to find the passage in the source file."""
    return f"[{number}] {hit.title} ({hit.doc_id}, chars {hit.start}-{hit.end})"


def build_prompt(question: str, hits: Sequence[Hit]) -> str:
    """The LLM prompt: instructions, each hit as a numbered source with its text, the question."""
    sources = "\n\n".join(f"{citation(i, h)}\n{h.text}" for i, h in enumerate(hits, start=1))
    return f"{INSTRUCTIONS}\n\nSources:\n\n{sources or '(none found)'}\n\nQuestion: {question}\n"


# ---------------------------------------------------------------------------------------------
# PLACEHOLDER: replace this function with a call to your LLM (OpenAI, Anthropic, a local model).
# ---------------------------------------------------------------------------------------------
def call_llm(prompt: str) -> str:
    """Returns a notice instead of an answer, listing the sources an answer would cite."""
    cited = "\n".join(f"  {line}" for line in prompt.splitlines() if CITATION.match(line))
    return (
        "[placeholder] call_llm() is not connected to a language model; replace it in "
        f"examples/chat_app.py. The prompt has {len(prompt)} characters and would cite:\n"
        f"{cited or '  (no sources)'}"
    )


def retrieve(
    question: str, *, url: str | None, k: int, mode: Mode | None, collection: str | None
) -> list[Hit]:
    if url:
        from rag_retriever.client import RetrieverClient

        with RetrieverClient(url, api_key=os.environ.get("RAG_API_KEY") or None) as client:
            return client.search(question, k=k, mode=mode, collection=collection)
    from rag_retriever import Retriever, Settings

    retriever = Retriever.from_settings(Settings.from_env(collection=collection))
    return retriever.search(question, k=k, mode=mode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("question")
    parser.add_argument("--url", help="a running `rag-retriever serve` (default: in-process)")
    parser.add_argument("--collection", help="alias to search (default RAG_COLLECTION)")
    parser.add_argument("-k", type=int, default=4, help="sources in the prompt (default 4)")
    parser.add_argument("--mode", choices=MODES, help="default: rerank if configured, else hybrid")
    parser.add_argument("--show-prompt", action="store_true", help="print the prompt as well")
    args = parser.parse_args(argv)

    hits = retrieve(
        args.question, url=args.url, k=args.k, mode=args.mode, collection=args.collection
    )
    prompt = build_prompt(args.question, hits)
    if args.show_prompt:
        print(prompt)
    print(call_llm(prompt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
