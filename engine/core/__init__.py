"""The worker core every worker runs: the KV cache manager (tokens to blocks), the scheduler
(request queues, admission, preemption) and the request states they share."""
