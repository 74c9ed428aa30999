"""jenga: the two-level LCM allocator for heterogeneous KV caches. Integers only, no torch.

The public API, importable from here (``from jenga import JengaAllocator``):

- layer and model specs (`jenga.specs`) and the per-kind policies (`jenga.policies`);
- presets and Hugging Face configs (`jenga.presets`, `jenga.hf`);
- page tables (`jenga.pages`);
- the allocator (`jenga.allocator`), its configuration and rules (`jenga.config`),
  errors (`jenga.errors`) and per-request types (`jenga.requests`);
- the prefix cache's hashing (`jenga.prefix`) and the mapping plans it emits
  (`jenga.plan`).

Modules inside jenga import their siblings directly, never through this facade (so
importing one never runs the others; tests/test_layout.py rejects import circles).
The simulator is the subpackage `jenga.sim`, not re-exported.
"""

from jenga import presets
from jenga.allocator import JengaAllocator, Usage
from jenga.config import AllocationOrder, AllocationRules, AllocatorConfig, GroupConfig
from jenga.errors import (
    AllocatorError,
    CapacityInUse,
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    InvalidSize,
    PageTooLarge,
    UnknownRequest,
)
from jenga.hf import HfOptions, model_spec_from_config
from jenga.pages import (
    DEFAULT_CHUNK_BYTES,
    GroupPages,
    PageTable,
    static_page_table,
    tokens_needed,
    uniform_paged_waste,
    vmm_page_table,
)
from jenga.plan import MapPage, MappingPlan, UnmapPage
from jenga.policies import POLICY_BY_KIND, Policy, make_policy, policy_for
from jenga.prefix import BlockIdentity, HashChain, image_block_hashes, root_hash
from jenga.requests import NULL_BLOCK, Allocation, BlockCopy, ImageSpan
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError, group_layers

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "NULL_BLOCK",
    "POLICY_BY_KIND",
    "Allocation",
    "AllocationOrder",
    "AllocationRules",
    "AllocatorConfig",
    "AllocatorError",
    "BlockCopy",
    "BlockIdentity",
    "CapacityInUse",
    "DoubleFree",
    "DuplicateRequest",
    "GroupConfig",
    "GroupPages",
    "HashChain",
    "HfOptions",
    "ImageSpan",
    "InvalidInput",
    "InvalidSize",
    "JengaAllocator",
    "KVGroup",
    "Kind",
    "LayerSpec",
    "MapPage",
    "MappingPlan",
    "ModelSpec",
    "PageTable",
    "PageTooLarge",
    "Policy",
    "SpecError",
    "UnknownRequest",
    "UnmapPage",
    "Usage",
    "group_layers",
    "image_block_hashes",
    "make_policy",
    "model_spec_from_config",
    "policy_for",
    "presets",
    "root_hash",
    "static_page_table",
    "tokens_needed",
    "uniform_paged_waste",
    "vmm_page_table",
]
