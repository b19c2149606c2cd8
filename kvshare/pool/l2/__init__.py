"""The L2 tier: hosts share committed chunks through Valkey/Redis (standalone or cluster), written behind and promoted.

config.py (L2Config, the --l2-* flags), codec.py (Redis key names and the value format), breaker.py (circuit
breaker), store.py (the Redis connection: timeouts, breaker, pipelined SET/GET), writer.py (the write-behind queue
and its worker thread), promoter.py (L2 -> L1 promotion on LOOKUP), tier.py (what the pool server calls).
"""
