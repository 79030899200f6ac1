"""The tier side of both modes: the chunk service the embedded data plane and the server's chunk
routes share (``service.ChunkService``)."""

from gateway.chunks.service import ChunkService, KeysUnavailable, Opened

__all__ = ["ChunkService", "KeysUnavailable", "Opened"]
