"""The worker side of a request: the upstream clients, one attempt's relay, pass-through, prefetch."""
