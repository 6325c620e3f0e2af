"""The HTTP side: the OpenAI-compatible gateway and how a process reaches servers and the registry.

The gateway's handlers, state and stream relay; the transport and its keep-alive pool; the capacity lease
client; the pool connection that composes a dispatcher, a policy, a transport and leases for any process.
Sits on top of the core and the routing policies; nothing in them imports it.
"""
