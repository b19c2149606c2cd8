"""The L2 tier: hosts share committed chunks through Valkey/Redis (standalone or cluster), written behind and promoted.

config.py (L2Config, the --l2-* flags), codec.py (Redis key names and the value format), breaker.py (circuit
breaker), store.py (the redis-py connection: timeouts, breaker, pipelined SET/GET), writer.py (the write-behind queue
and its worker thread), install.py (verified chunks into L1: RESERVE, copy, COMMIT), striped.py (the default
promotion: striped, pipelined, verification overlapping the fetches), lanes.py (its connections, one thread each),
resp.py (the RESP2 reader those use), topology.py (which node holds a key), buffers.py (reused receive buffers),
promoter.py (the original redis-py promotion, kept for comparison), tier.py (what the pool server calls).
"""
