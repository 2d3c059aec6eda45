"""vLLM V1 engine integration: scheduler side (how many tokens survive, pages freed) and worker side
(which tokens survive, compaction in place). Nothing here knows any eviction method."""
