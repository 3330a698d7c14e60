"""The HTTP service: the FastAPI app (`server`), its write routes (`writes`), API keys
(`auth`) and Prometheus metrics (`metrics`). The client that talks to it is
`rag_retriever.client`; the LangChain retriever is `rag_retriever.langchain`.
"""
