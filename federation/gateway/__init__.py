"""The HTTP side: the OpenAI-compatible gateway and how a process reaches servers and the registry.

The gateway's handlers, state, auth and stream relay (handlers.py, state.py, auth.py, streams.py); the Batch API
and its store (batches.py, batchstore.py); the transport: a plain answer over the keep-alive pool (transport.py),
the rest over aiohttp (unpooled.py), what answers say (answers.py); the capacity lease client (leases.py); the pool
connection that composes a dispatcher, a policy, a transport and leases for any process (pool.py). Sits on top of
the core and the routing policies; nothing in them imports it.
"""
