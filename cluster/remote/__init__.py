"""The engine as a named Ray actor, and the client side of it: handles in other processes
reach it over a channel of batched msgpack messages."""
