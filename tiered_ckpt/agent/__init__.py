"""The node agent: one process per user and machine that drains saves to the slower tiers after the trainer
committed them on the memory tier, so a trainer that dies then still gets its disk, peer and S3 copies
(`[engine] agent = "on"`; docs/architecture.md, *The process boundary*; docs/operations.md, *The node agent*).

folder.py: the user's folder (0700) and the socket's path; wire.py: msgpack frames over the Unix socket, file
descriptors beside them; server.py: the agent (asyncio), links.py: the tiers and index it opens per job; client.py:
the trainer's side (starts the agent, hands a save off, learns each tier's outcome)."""
