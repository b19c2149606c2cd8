#!/usr/bin/env bash
# Carries vLLM 0.26.0 for CUDA and the dependencies the H200 host lacks to that host, in pieces of one device call
# each (docs/vllm-on-h200.md):
#   bash scripts/carry-vllm.sh prepare [--kernels] [--lmcache]
#                                                    here: download, split, manifest; prints the device calls
#                                                    (--lmcache: also LMCache 0.5.3 for vLLM's LMCacheConnectorV1)
#   bash scripts/carry-vllm.sh plan                  here: prints those calls again
#   bash scripts/carry-vllm.sh receive N [N...]      on the host: piece N into /tmp/vllm-carry, sha256 checked
#   bash scripts/carry-vllm.sh install               on the host: reassemble, check, install into /tmp/vllm-site,
#                                                    import vllm (and lmcache with its vLLM connector, if carried)
# VLLM_CARRY_TMP, VLLM_CARRY_SITE and VLLM_CARRY_PYTHON override /tmp/vllm-carry, /tmp/vllm-site and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python  # here; the host has no .venv (it is never carried)
exec "$py" scripts/carry_vllm.py "$@"
