"""The ways into the engine: the msgpack socket server, the replica router, and the
metrics they export. Everything here uses the engine in `cadence.actors`; nothing in
the engine imports this wing."""
