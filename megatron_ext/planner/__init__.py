"""Planning a cluster run before it starts: memory, communication and step time per rank,
torch-free."""
