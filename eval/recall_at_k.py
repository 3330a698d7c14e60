"""`python eval/recall_at_k.py --collection NAME --questions FILE.jsonl`: per-question evaluation.

The command lives in the package (`rag_retriever.eval.recall_at_k`, with the metric functions,
the questions and the report); this file is its entry point from a source checkout.
"""

import sys

from rag_retriever.eval.recall_at_k import main

if __name__ == "__main__":
    sys.exit(main())
