"""Training data: tokenizers, raw text sources, and the packed, resumable per-dp-rank stream."""
