"""Moved to `rag_retriever.service.server`; this import path, kept since 0.3 so that code
written against 0.2 keeps working, still works in 0.4. New code imports from `rag_retriever` or `rag_retriever.service.server`.
"""

from rag_retriever.service.server import *  # noqa: F403
