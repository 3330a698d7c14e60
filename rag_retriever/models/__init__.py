"""The models: what turns text into vectors, scores and terms.

- `encoder`: the bi-encoder (passage and query vectors, masked-mean or CLS pooling, L2-normalised).
- `reranker`: the cross-encoder that reorders the fused candidates.
- `bm25`: the lexical model (analysis, the document side's saturated term weights, the query
  side's IDF).
- `profiles`: each model's prefixes and pooling; `hub`: a model's folder (a hub id from the
  cache first); `token_counter`: token counts without the model; `attention`: grouped CPU
  attention; `device`: device and precision; `quiet`: loading a model without its noise.

Nothing here reads a collection or knows about versions (the store records what a model wrote).
"""
