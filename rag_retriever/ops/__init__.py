"""Operating a collection: `doctor` (drift, near-duplicates, stage health from the query log)."""
