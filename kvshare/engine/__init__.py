"""The reference engine (`kvshare serve` runs it): model, paged KV cache, local prefix cache, scheduler, sampler,
the loop (engine.py), and its side of the KV connector (pool_hooks.py, pool_connector.py)."""
