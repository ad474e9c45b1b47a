"""Storage tiers below the RAM arena. Each tier moves bytes and keeps its own index; the engine decides.

- `kvstore.tiers.disk`: log-structured segment files written with O_DIRECT, an lmdb index (metadata only),
  xxh3 checksums on every block, optional zstd compression. Public facade: `DiskStore`, configured by
  `DiskConfig`; its `__init__.py` lists one module per concern.

Nothing is re-exported here, so importing `kvstore.tiers` costs nothing; import the tier's package.
"""
