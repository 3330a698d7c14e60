"""Moved to `rag_retriever.models.reranker`; this import path is kept for one release (0.3) so that code
written against 0.2 keeps working. New code imports from `rag_retriever` or `rag_retriever.models.reranker`.
"""

from rag_retriever.models.reranker import *  # noqa: F403
