"""The dispatch core: one process's dispatcher and its books.

The dispatcher (the retry loop), the grant pass and routes (who waits, in what order), the server book and
the in-flight ledger (slots counted in the same step as the choice), the client book (the serving order),
learning (speeds, windows), typed failures and retries, copies at a client's tail, and the policy interface
the routing policies implement. Imports nothing of federation's other rooms and no HTTP library.
"""
