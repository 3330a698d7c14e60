"""The query path: a question in, hits out.

- `retriever`: `Retriever.search` (encode, the dense and BM25 lists in one engine call, fusion,
  reranking, diversity, context) and the `Hit`s it returns; `hits`: `SearchHits`, what
  `search()` returns (a list of hits with the search's `query_id`; the HTTP clients' too).
- `fusion`: the ranked lists merged (pure functions); `diversity`: maximal marginal relevance;
  `context`: neighbouring chunks merged with exact offsets; `cache`: the semantic cache;
  `chunk_table`: chunk reads by id; `querylog`: the query log (written off the request path,
  read back per alias).

Nothing here writes a version (that is `rag_retriever.ingest`).
"""
