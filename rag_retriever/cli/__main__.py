"""`python -m rag_retriever.cli`: the `rag-retriever` command."""

import sys

from rag_retriever.cli import main

sys.exit(main())
