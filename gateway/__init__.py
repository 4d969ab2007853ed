"""The gateway: the OpenAI-compatible HTTP front door (tokenizes, routes, streams, cancels; holds no KV state).

Kept import-free, so `pagedkv serve --help` can name the routing policies without loading the gateway.
"""

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
