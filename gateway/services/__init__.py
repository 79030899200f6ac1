"""The gateway's services, built once from settings (``runtime``) and handed to whoever needs
them: capabilities (``access``), namespaces and storage keys (``namespaces``), pins, secure clear
and tenants (``admin``), invalidation and cluster events (``invalidation``, ``broadcast``), the
audit signer and checkpoints (``auditing``), KEK rotation (``kekrotate``), state files and the
schema (``statefiles``, ``dbschema``), the published server URL (``serverinfo``), and the core's
facade over them (``core.Gateway``)."""
