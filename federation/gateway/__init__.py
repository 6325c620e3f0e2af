"""The HTTP side: the OpenAI-compatible gateway and how a process reaches servers and the registry.

The gateway's handlers, state, auth and stream relay (handlers.py, state.py, auth.py, streams.py); the Batch API
and its store (batches.py, batchstore.py); the transport: a plain answer over the keep-alive pool (transport.py),
the rest over aiohttp (unpooled.py), what answers say (answers.py); the capacity lease client (leases.py); the pool
connection that composes a dispatcher, a policy, a transport and leases for any process (pool.py). Sits on top of
the core and the routing policies; nothing in them imports it.
"""

# What a caller may tell the gateway about itself, beside its request (handlers.py reads them; an `eval run
# --gateway` sends them, clients/delegate.py): here, so that a client need not import the gateway's app to name them.
CLIENT_HEADER = "X-Fedpool-Client"  # a caller without a key names itself
# A caller's run size: how many requests it sends in all (`DeclaredRuns`); the header, or the URL's query for a tool
# that takes only a URL (lm-eval's `base_url=http://gateway/v1/completions?fedpool_requests=60`).
REQUESTS_HEADER = "X-Fedpool-Requests"
REQUESTS_QUERY = "fedpool_requests"
PROMPT_HEADER = "X-Fedpool-Prompt-Tokens"  # beside the run size (`eval run --gateway`): its mean prompt (DeclaredRuns)
