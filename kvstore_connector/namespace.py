"""Namespaces: blocks are only exchanged between identical KV layouts.

namespace = model id + a digest of the KV layout (dtype, block size, layers, KV heads, head dim, TP rank and
size, stored-block size, and which of the model's layers: ``first_layer`` .. ``first_layer + num_layers``)
+ the request's cache_salt. Two models, two TP layouts, two pipeline stages or two salts never share a block:
a hit across them would hand a model someone else's KV and produce garbage, silently.

Pipeline parallelism: each stage's workers hold and store only their own layers, so each stage has its own
namespace, named by its global layer range (not by its rank: two configurations that give a stage the same
layers store the same bytes, and may share them). The scheduler, one process for all stages, looks a prefix
up in every stage's namespace (`StageLayouts`) and offers only what every stage can load.

The scheduler (which looks up) and the worker (which stores and loads) build the same specs from the vLLM
config, so they agree on the names without talking to each other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvstore_connector.groups import FULL, GroupKind

__all__ = ["KVLayoutSpec", "StageLayouts", "namespace_for", "registration"]

_BAD = re.compile(r"[^A-Za-z0-9._:@+=-]+")


@dataclass(frozen=True)
class KVLayoutSpec:
    model: str
    dtype: str
    block_size: int
    num_layers: int        # layers of this pipeline stage
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    blocks_per_key: int
    first_layer: int = 0   # global index of this stage's first layer (0 without pipeline parallelism)
    # KV cache groups (vLLM's hybrid manager): which group of how many this shard stores, its kind, its layers
    # on this stage, and the bytes of one vLLM block of them (vLLM's page size: MLA has one latent, not K and V)
    kind: GroupKind | None = None  # None: the model's only group, full attention (names as before groups)
    group_index: int = 0
    group_count: int = 1
    group_layers: int = 0
    page_bytes: int = 0            # 0: the standard K and V formula
    kv_layout: str = ""            # vLLM's KV cache layout name (LBHNC, LBNHC, ...): the byte order of a page

    @property
    def group_kind(self) -> GroupKind:
        return self.kind or FULL

    @property
    def bytes_per_token(self) -> int:
        """vLLM's page size when known, else K and V for every layer, this rank's heads (the worker checks the
        real size)."""
        if self.page_bytes:
            return self.page_bytes // self.block_size
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def tokens_per_key(self) -> int:
        return self.block_size * self.blocks_per_key

    @property
    def layer_range(self) -> tuple[int, int]:
        return self.first_layer, self.first_layer + self.num_layers

    def digest(self) -> str:
        """Covers the full model string too: two fine-tunes named .../llama in different orgs must not mix.

        ``first_layer`` enters only when it is not 0, so a layout without pipeline stages keeps the name it
        had before stages were named (blocks stored by an earlier version stay reachable); stage 0 is still
        told apart from the whole model by ``num_layers``. The group fields enter the same way: a model with one
        full-attention group keeps its name, and so does every layout whose page size follows the K and V formula."""
        body = asdict(self)
        if not self.first_layer:
            del body["first_layer"]
        if not self.kv_layout:  # unknown (vLLM before 0.32, tests): the name it had before layouts were named
            del body["kv_layout"]
        if self.kind is None:
            for name in ("kind", "group_index", "group_count", "group_layers"):
                del body[name]
            if not self.page_bytes:
                del body["page_bytes"]
        else:  # a hybrid group: its layer count and page bytes on another pipeline stage are not known to every
            del body["group_layers"], body["page_bytes"]  # process (vllm_connector.stage_specs); the stage's
            #                                               layer range and the group's index pin its layers

        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _dtype_bytes(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    for prefix, n in (("float8", 1), ("fp8", 1), ("uint8", 1), ("int8", 1), ("bfloat16", 2), ("float16", 2),
                      ("half", 2), ("float32", 4), ("float", 4), ("float64", 8)):
        if name.startswith(prefix):
            return n
    raise ValueError(f"unknown KV cache dtype {dtype!r}")


@functools.lru_cache(maxsize=4096)
def namespace_for(spec: KVLayoutSpec, cache_salt: str | None = None, tenant: str = "") -> str:
    """A valid kvstore namespace name (<= 200 chars of [A-Za-z0-9._:/@+=-]):
    vllm/<model>/<digest>[/tenant=<tenant>][/salt=..].

    ``tenant``: the tenant this process's token belongs to, as the daemon names it (Client.tenant; '' without
    tokens, and the name is the one it always was). With tokens a namespace belongs to the tenant that
    registered it, so two tenants serving the same model need two names: without the tenant in it the second
    one's registration is refused ("taken") and its vLLM runs without the store. Tenant names are
    [A-Za-z0-9._-]{1,64}: the longest name, with an 80-character model, a salt and a tenant, is 196 characters.

    The model part never holds a "/", so the digest is always the third part (`StageLayouts.registration`).
    Cached (the spec is frozen): the digest (asdict, JSON, SHA-256) cost ~0.18 ms, and a save step asked for it
    twice a part, 7 % of a 512-token step's wait_for_save (bench.connector)."""
    model = _BAD.sub("-", spec.model.strip("/").split("/")[-1] if "/" in spec.model else spec.model)[:80] or "model"
    name = f"vllm/{model}/{spec.digest()}"
    if tenant:
        name += "/tenant=" + tenant
    if cache_salt:
        name += "/salt=" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]
    return name


def registration(spec: KVLayoutSpec) -> dict[str, object]:
    """RegisterNamespace arguments for every namespace of this layout: the daemon shows them in `kvstore ls`
    and, knowing tokens per stored block, reports lookups and hits in tokens."""
    return {"model": spec.model, "layout_digest": spec.digest(), "tokens_per_block": spec.tokens_per_key}


class StageLayouts:
    """The layouts of every pipeline stage of one model (one entry without pipeline parallelism); on the
    scheduler, of every (stage, TP rank) shard, since each TP rank stores its own heads in its own namespace.

    All stages share one key chain, so they must agree on tokens per stored block; a mismatch is a bug in
    whoever built the specs (every process must resolve ``blocks_per_key`` for the whole model, not per stage).
    """

    def __init__(self, specs: Sequence[KVLayoutSpec]) -> None:
        if not specs:
            raise ValueError("StageLayouts needs at least one stage")
        per_key = {s.tokens_per_key for s in specs}
        if len(per_key) != 1:
            raise ValueError(f"pipeline stages disagree on tokens per stored block: {sorted(per_key)}")
        self.specs = tuple(specs)
        self._by_digest = {s.digest(): s for s in specs}

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def tokens_per_key(self) -> int:
        return self.specs[0].tokens_per_key

    def names(self, cache_salt: str | None = None, tenant: str = "") -> list[str]:
        """One namespace per stage, in stage order."""
        return [namespace_for(s, cache_salt, tenant) for s in self.specs]

    def registration(self, name: str) -> dict[str, object]:
        """RegisterNamespace arguments of a name built by `namespace_for` from one of these stages."""
        parts = name.split("/")
        spec = self._by_digest.get(parts[2]) if len(parts) > 2 else None
        if spec is None:
            raise KeyError(f"namespace {name!r} belongs to none of this model's {len(self.specs)} stage layouts")
        return registration(spec)
