"""The kvgate HTTP server (FastAPI): data plane, admin API, telemetry."""

from gateway.server.app import create_app

__all__ = ["create_app"]
