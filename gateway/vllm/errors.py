"""Errors of the vLLM integration (the connector, the tenant middleware and the proxy).

    GatewayError                       (gateway.errors)
     +-- ConnectorConfigError          bad kv_connector_extra_config, chunk size not a multiple
     |                                 of vLLM's block size, an unsupported paged-KV layout
     +-- GatewayTimeout                the connector's backend did not answer within timeout_s
     +-- TenantRequestError            a request the middleware answers itself
          +-- Unauthorized  (401)      no, malformed or unverifiable bearer token
          +-- Forbidden     (403)      authenticated, but no capability could be minted for it
          +-- BadRequest    (400)      a body that is not a JSON object
          +-- Unavailable   (503)      the gateway cannot be reached or cannot mint at the moment
                                       (an outage, never told as a permission error)

Inside the engine nothing here is raised per request: a missing or refused capability, a miss, a
failed tag or an unreachable gateway make the connector report zero hits or failed blocks."""

from __future__ import annotations

from gateway.errors import GatewayError

__all__ = ["BadRequest", "ConnectorConfigError", "Forbidden", "GatewayTimeout", "TenantRequestError", "Unauthorized", "Unavailable"]


class ConnectorConfigError(GatewayError, ValueError):
    pass


class GatewayTimeout(GatewayError):
    """The gateway (in-process core or remote server) did not answer within the backend's
    timeout; the operation is abandoned and counts as a miss."""


class TenantRequestError(GatewayError):
    status = 400
    title = "Bad Request"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(TenantRequestError):
    status = 401
    title = "Unauthorized"


class Forbidden(TenantRequestError):
    status = 403
    title = "Forbidden"


class BadRequest(TenantRequestError):
    status = 400
    title = "Bad Request"


class Unavailable(TenantRequestError):
    status = 503
    title = "Service Unavailable"
