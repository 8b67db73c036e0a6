"""The engine core every worker runs: the scheduler (request queues, admission, preemption),
the KV cache manager over the block pool (free queue, prefix cache, block hashing, KV events)
and the KV connector interface through which KV moves in and out of the paged cache."""
