"""`python ingest/ingest.py PATH --collection NAME`: ingest a corpus into a new version.

The same command as `rag-retriever ingest` (every flag, `--help`); the ingest path itself is the
package `rag_retriever.ingest` (loaders, chunking, the pipeline, the versioned writer,
compaction). This file is its entry point from a source checkout, as `eval/recall_at_k.py` is
the evaluation's.
"""

import sys

from rag_retriever.cli import main

if __name__ == "__main__":
    sys.exit(main(["ingest", *sys.argv[1:]]))
