"""Moved to `rag_retriever.query.retriever`; this import path is kept for one release (0.3) so that code
written against 0.2 keeps working. New code imports from `rag_retriever` or `rag_retriever.query.retriever`.
"""

from rag_retriever.query.retriever import *  # noqa: F403
