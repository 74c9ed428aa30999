"""Elastic sharing of one device's chunk budget between processes (see docs/multi-tenant.md).

owner = PoolOwner("gpu0", budget_bytes=8 << 30)       # or: vmm-pool start gpu0 --budget 8G
backend = join_pool("gpu0", "llama", min_bytes=1 << 30, max_bytes=6 << 30)
pool = vmm.ChunkPool(backend, backend.tenant.max_bytes)
"""

from vmm.shared.guard import AccessPolicy
from vmm.shared.owner import PoolOwner
from vmm.shared.protocol import ProtocolError
from vmm.shared.tenant import PoolRefused, Tenant, TenantBackend, join_pool

__all__ = [
    "AccessPolicy",
    "PoolOwner",
    "PoolRefused",
    "ProtocolError",
    "Tenant",
    "TenantBackend",
    "join_pool",
]
