"""The grid over Kubo: one module per concern, all below the `Transport` interface.

kubo.py         the Kubo RPC calls gridgraph needs (pubsub, blocks)
transport.py    `Transport` over one Kubo node: PubSub messages, large payloads as blocks
discovery.py    heartbeats on the discovery topic: which peer owns which worker name
client.py       `connect()`: a `Grid` of the live workers, and its keep-alive
worker_main.py  the worker process (`gridgraph worker`)
swarm.py        local loopback swarms and worker processes for tests, demos, benchmarks
"""
