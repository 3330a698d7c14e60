"""Moved to `rag_retriever.models.reranker`; this import path, kept since 0.3 so that code
written against 0.2 keeps working, still works in 0.4. New code imports from `rag_retriever` or `rag_retriever.models.reranker`.
"""

from rag_retriever.models.reranker import *  # noqa: F403
