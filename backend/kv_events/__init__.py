"""KV cache events for cache-aware routers: which blocks of the prefix cache a replica stores and
drops, published on a ZeroMQ PUB socket in the wire format vLLM uses and NVIDIA Dynamo's KV router
reads (docs/kv_events.md).

events.py: the records, the log the block manager writes into and the msgpack encoding;
endpoint.py: an endpoint's checks (loopback unless allowed) and its address per replica;
publisher.py: the socket, on a thread of its own behind a bounded queue (imports zmq).
"""
