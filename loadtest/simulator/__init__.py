"""`pdcluster simulate`: a trace-driven discrete-event simulation of a prefill/decode cluster
that runs the real Conductor (router.conductor), block pools and global index, so a cluster can
be planned before it is bought. Modules: workload (trace → requests and block keys), cache
(simulated tiers), decode (closed-form continuous batching), engine (the event loop), results
(metrics), plots, cli."""
