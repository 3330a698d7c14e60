"""Moved to `rag_retriever.models.encoder`; this import path is kept for one release (0.3) so that code
written against 0.2 keeps working. New code imports from `rag_retriever` or `rag_retriever.models.encoder`.
"""

from rag_retriever.models.encoder import *  # noqa: F403
