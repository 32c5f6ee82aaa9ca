"""DiPaCo's task queue, torch-free: the queue (leases, fencing tokens), its database (SQLite in
WAL mode or PostgreSQL), its URL, a worker's heartbeat and ``megatron-ext dipaco status``."""
