"""What a path reads: the corpus, its split, each path's batches, documents to score, and the
routing features the base model gives them."""
