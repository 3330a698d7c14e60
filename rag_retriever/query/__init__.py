"""The query path: a question in, hits out.

- `retriever`: `Retriever.search` (encode, the dense and BM25 lists in one engine call, fusion,
  reranking, diversity, context) and the `Hit`s it returns.
- `fusion`: the ranked lists merged (pure functions); `diversity`: maximal marginal relevance;
  `context`: neighbouring chunks merged with exact offsets; `cache`: the semantic cache;
  `chunk_table`: chunk reads by id; `querylog`: the query log's writing side.

Nothing here writes a version (that is `rag_retriever.ingest`).
"""
