"""kvgate for vLLM: the KV connector, the tenant middleware and the tenant proxy.

    gateway.vllm.connector.KvgateConnector   --kv-transfer-config '{"kv_connector": "KvgateConnector",
                                               "kv_connector_module_path": "gateway.vllm.connector", ...}'
    gateway.vllm.middleware.KvgateMiddleware --middleware gateway.vllm.middleware.KvgateMiddleware
    gateway.vllm.proxy.create_proxy          the same checks as a standalone reverse proxy
    gateway.vllm.salt.cache_salt             the tenant's cache_salt (HMAC, length-prefixed)

vLLM is imported only by ``connector`` (so ``import gateway`` and the middleware never need it).
"""

__all__: list[str] = []
