"""kvgate for vLLM: the KV connector, the tenant middleware and the tenant proxy.

    gateway.vllm.connector.KvgateConnector   --kv-transfer-config '{"kv_connector": "KvgateConnector",
                                               "kv_connector_module_path": "gateway.vllm.connector", ...}'
    gateway.vllm.middleware.KvgateMiddleware --middleware gateway.vllm.middleware.KvgateMiddleware
    gateway.vllm.proxy.create_proxy          the same checks as a standalone reverse proxy
    gateway.vllm.salt.cache_salt             the tenant's cache_salt (HMAC, length-prefixed)

Inside: ``connector`` (the shell vLLM instantiates; hands each hook to one side), ``scheduler``
(lookups, load and store plans; no vLLM, no torch), ``worker`` (the KV cache, loads, stores, load
errors), ``ledger`` (the rules of both sides: which loads and stores a step carries, where a failed
load cuts a store), ``backend`` (embedded core or remote server, and its loop thread), ``config``
(kv_connector_extra_config and KVGATE_VLLM_* as pydantic models), ``guard``, ``middleware``,
``proxy``, ``salt`` (the tenant checks in front of vLLM's OpenAI server), ``disagg`` (the P/D proxy),
``relay`` (the HTTP forwarding of both proxies), ``logs``, ``errors``.
vLLM is imported only by ``connector`` (so ``import gateway`` and the middleware never need it)."""

__all__: list[str] = []
