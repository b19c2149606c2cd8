"""Run by tests/integrations/test_vllm_api_versions.py in a vLLM interpreter (.venv-vllm, with the vllm sources it
should see first on PYTHONPATH): prints, as JSON, what kvshare's connector and kvshare.integrations.vllm.compat do
under the vllm it imports and under the API named by each facts file given as an argument.

    python tests/integrations/vllm_api_probe.py tests/integrations/vllm_api_0_26.json ...
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from types import SimpleNamespace

import vllm.v1.attention.backends.utils as backend_utils
import vllm.v1.attention.selector as selector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvshare.integrations.vllm import KVShareConnector, compat

MARKER = "KVSHARE-PROBE "  # the result line's prefix (vLLM may log on stdout)


def params(fn) -> list[list[str]]:
    return [[p.name, p.kind.name] for p in inspect.signature(fn).parameters.values()]


def raw(member):
    """The function behind a class-dict entry: a property's getter, a classmethod's function."""
    if isinstance(member, property):
        return member.fget, "property"
    if isinstance(member, classmethod):
        return member.__func__, "classmethod"
    return member, "method"


def connector_methods() -> dict:
    """Public hooks KVShareConnector defines itself: {name: {params, kind}}."""
    out = {}
    for name, member in vars(KVShareConnector).items():
        if name.startswith("_") and name != "__init__":
            continue
        fn, kind = raw(member)
        if callable(fn):
            out[name] = {"params": params(fn), "kind": kind}
    return out


def live_base() -> dict:
    """The imported vllm's KVConnectorBase_V1 and SupportsHMA methods, as the facts files list them."""
    out = {}
    for cls in (KVConnectorBase_V1, SupportsHMA):
        methods = {}
        for name, member in vars(cls).items():
            fn, kind = raw(member)
            if inspect.isfunction(fn):
                methods[name] = {"params": params(fn), "kind": kind,
                                 "abstract": bool(getattr(fn, "__isabstractmethod__", False))}
        out[cls.__name__] = methods
    return out


def api_of(facts: dict) -> compat.VllmApi:
    base = facts["base_classes"]["KVConnectorBase_V1"]
    modules = [m for m, names in facts["modules"].items() if names is not None]
    return compat.VllmApi.from_names(facts["version"], base, facts["base_module_names"], facts["fields"], modules)


def steps() -> list[SimpleNamespace]:
    """Three SchedulerOutputs, with only the fields BlockTables reads: a new request, its next step with a new block,
    a second request; then a finished one and a resumed one (its whole table replaced)."""
    def out(new=(), cached=(), resumed=(), finished=()):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], resumed_req_ids=set(resumed),
                                                  new_block_ids=[b for _, b in cached]),
            finished_req_ids=set(finished))
    return [out(new=[("a", ([1, 2],))]),
            out(cached=[("a", ([3],))], new=[("b", ([4],))]),
            out(cached=[("a", None), ("b", ([7, 8],))], resumed={"b"}, finished={"x"})]


def behaviour(api: compat.VllmApi) -> dict:
    """What compat does under `api`, with stand-ins for vLLM's objects (the fields each version declares)."""
    manager = object()
    connector = SimpleNamespace(_kv_cache_manager=manager)
    tables = compat.new_block_tables(api)
    seen = []
    for output in steps():
        source = compat.block_source(connector, tables, output, api)
        seen.append("manager" if source is manager else {r: [list(g) for g in source.get_block_ids(r)]
                                                          for r in ("a", "b") if r in source._tables})
    layouts = {}
    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="LBHNC", cache_dtype="auto"),
                             model_config=SimpleNamespace(dtype="float32", is_mm_prefix_lm=False))
    kv_config = SimpleNamespace(kv_cache_layout=None)
    layer = SimpleNamespace(head_size=64)  # the attention layers' spec
    saved = [(module, name, getattr(module, name, None))
             for module, name in ((backend_utils, "get_kv_cache_layout"), (selector, "get_attn_backend"))]
    try:
        for legacy in ("NHD", "HND"):
            for required in (None, "HND", "NHD"):
                # vLLM 0.26's resolver and backend selection, stood in: the layout the process would resolve, and
                # the one the layers' backend requires.
                backend_utils.get_kv_cache_layout = lambda legacy=legacy: legacy
                backend = SimpleNamespace(get_required_kv_cache_layout=lambda required=required: required)
                selector.get_attn_backend = lambda *args, backend=backend, **kwargs: backend
                layouts[f"{legacy}/{required}"] = compat.resolved_layout_name(config, kv_config, layer, api)
    finally:
        for module, name, value in saved:
            if value is None:
                delattr(module, name)
            else:
                setattr(module, name, value)
    try:
        compat.require_hybrid_support("FullAttentionSpec, MambaSpec", api)
        hybrid = None
    except ValueError as error:
        hybrid = str(error)
    spec = SimpleNamespace(head_size=64)  # 0.26: an AttentionSpec subclass without head_size_v
    try:
        head_v = compat.head_size_v(spec, api)
    except AttributeError:
        head_v = "AttributeError"
    return {"api": dataclasses.asdict(api), "block_tables": seen, "layouts": layouts, "hybrid_error": hybrid,
            "head_size_v_without_field": head_v}


def main(paths: list[str]) -> None:
    by_file = {}
    for path in paths:
        with open(path) as f:
            by_file[path] = behaviour(api_of(json.load(f)))
    print(MARKER + json.dumps({
        "api": dataclasses.asdict(compat.API),
        "installed": behaviour(compat.API),
        "by_file": by_file,
        "connector": connector_methods(),
        "live_base": live_base(),
        "abstract_left": sorted(KVShareConnector.__abstractmethods__),
        "only_in_0_32": sorted(compat.ONLY_IN_0_32),
        "cache_hit_source": repr(vars(KVShareConnector).get("_cache_hit_source")),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
