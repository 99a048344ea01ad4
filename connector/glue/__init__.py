"""vLLM glue: the connector class, the push worker and the seams they use."""
