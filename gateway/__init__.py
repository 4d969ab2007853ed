"""The gateway: the OpenAI-compatible HTTP front door (tokenizes, routes, streams, cancels; holds no KV state).

Kept import-free, so `pagedkv serve --help` can name the routing policies and tool-call parsers without loading
the gateway.
"""

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
