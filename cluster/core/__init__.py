"""The engine: requests in, outputs out (replicas and their step loops, routing, placement,
health, detokenizing, streams, chat templates, metrics)."""
