"""Operating a collection: `doctor` (drift, near-duplicates, stage health from the query log) and `plan` (capacity of a corpus and a load from measured constants)."""
