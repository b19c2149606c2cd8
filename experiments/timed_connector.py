"""KVShareConnector with every hook timed: where does a storing request spend its time? (issue 24, part 3)

Use it instead of the connector (`experiments` on PYTHONPATH):
    --kv-transfer-config '{"kv_connector":"TimedKVShareConnector","kv_connector_module_path":"timed_connector",...}'
Each hook that takes longer than 1 ms logs one line `kvshare-timing <hook> <seconds>` (with the process id: the
scheduler half and the worker half live in different processes).
"""

from __future__ import annotations

import functools
import logging
import os
import time

from kvshare.integrations.vllm import KVShareConnector

log = logging.getLogger("vllm.kvshare.timing")
# wait_for_layer_load and save_kv_layer run once a layer: logged only when one call passes 1 ms (a wait that blocks)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "build_connector_worker_meta", "get_block_ids_with_load_errors")


def _timed(name, method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - started
            if took > 1e-3:
                log.warning("kvshare-timing %s %.4f pid=%d", name, took, os.getpid())
    return wrapper


TimedKVShareConnector = type("TimedKVShareConnector", (KVShareConnector,),
                             {name: _timed(name, getattr(KVShareConnector, name)) for name in HOOKS})
