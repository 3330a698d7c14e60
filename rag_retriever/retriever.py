"""Moved to `rag_retriever.query.retriever`; this import path, kept since 0.3 so that code
written against 0.2 keeps working, still works in 0.4. New code imports from `rag_retriever` or `rag_retriever.query.retriever`.
"""

from rag_retriever.query.retriever import *  # noqa: F403
