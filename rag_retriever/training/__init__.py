"""Training on the user's own labelled questions: the embedder and the cross-encoder reranker.

Both mine their examples from the user's own collection (positives: the gold chunks; negatives:
the collection's own BM25 and dense lists, never a gold chunk), hold out a validation part of
the questions, and save a model directory that the normal loading path uses as it is.
"""
